"""The results tables of the benchmarks that report a list of rows: one Markdown table and one CSV, same columns."""

from __future__ import annotations


def markdown_table(rows: list[dict]) -> str:
    header = list(rows[0])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(row[h]) for h in header) + " |" for row in rows])


def csv_text(rows: list[dict]) -> str:
    header = list(rows[0])
    return "\n".join([",".join(header)] + [",".join(str(row[h]) for h in header) for row in rows]) + "\n"
