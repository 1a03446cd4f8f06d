"""``python -m lit_model COMMAND ...``: the same as the ``lit-model`` command (lit_model/entry.py)."""

from lit_model.entry import main

main()
