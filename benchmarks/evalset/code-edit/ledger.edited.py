"""Format a household ledger as a plain-text monthly statement."""

import datetime as dt
from collections import defaultdict
from typing import Dict, Iterable, List, NamedTuple


class Entry(NamedTuple):
    day: dt.date
    account: str
    description: str
    amount: float  # positive: income, negative: spending


def money(amount: float) -> str:
    sign = "-" if amount < 0 else ""
    return f"{sign}{abs(amount):.2f}"


def header(owner: str, month: dt.date) -> str:
    title = f"Statement for {owner} - {month.strftime('%B %Y')}"
    return f"{title}\n{'=' * len(title)}"


def entry_line(entry: Entry) -> str:
    return (
        f"{entry.day.isoformat()}  {entry.account:<12} "
        f"{entry.description[:28]:<28} {money(entry.amount):>10}"
    )


def totals_by_account(entries: Iterable[Entry]) -> Dict[str, float]:
    totals: Dict[str, float] = defaultdict(float)
    for entry in entries:
        totals[entry.account] += entry.amount
    return dict(totals)


def footer(entries: List[Entry]) -> str:
    income = sum(e.amount for e in entries if e.amount > 0)
    spending = -sum(e.amount for e in entries if e.amount < 0)
    lines = [
        f"Income:   {money(income):>12}",
        f"Spending: {money(spending):>12}",
        f"Balance:  {money(income - spending):>12}",
    ]
    for account, total in sorted(totals_by_account(entries).items()):
        lines.append(f"  {account:<10} {money(total):>12}")
    return "\n".join(lines)


def statement(owner: str, month: dt.date, entries: Iterable[Entry]) -> str:
    rows = sorted(
        (e for e in entries if (e.day.year, e.day.month) == (month.year, month.month)),
        key=lambda e: (e.day, e.account),
    )
    if not rows:
        return f"{header(owner, month)}\n(no entries)"
    body = "\n".join(entry_line(e) for e in rows)
    return f"{header(owner, month)}\n{body}\n\n{footer(rows)}"


if __name__ == "__main__":
    sample = [
        Entry(dt.date(2024, 3, 1), "checking", "Salary", 2450.0),
        Entry(dt.date(2024, 3, 2), "checking", "Rent", -950.0),
        Entry(dt.date(2024, 3, 9), "card", "Groceries", -84.35),
        Entry(dt.date(2024, 3, 15), "savings", "Transfer in", 300.0),
    ]
    print(statement("R. Alvarez", dt.date(2024, 3, 1), sample))
