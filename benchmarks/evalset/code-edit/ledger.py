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
    return "%s%.2f" % (sign, abs(amount))


def header(owner: str, month: dt.date) -> str:
    title = "Statement for {} - {}".format(owner, month.strftime("%B %Y"))
    return "{}\n{}".format(title, "=" * len(title))


def entry_line(entry: Entry) -> str:
    return "%s  %-12s %-28s %10s" % (
        entry.day.isoformat(),
        entry.account,
        entry.description[:28],
        money(entry.amount),
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
        "Income:   {:>12}".format(money(income)),
        "Spending: {:>12}".format(money(spending)),
        "Balance:  {:>12}".format(money(income - spending)),
    ]
    for account, total in sorted(totals_by_account(entries).items()):
        lines.append("  %-10s %12s" % (account, money(total)))
    return "\n".join(lines)


def statement(owner: str, month: dt.date, entries: Iterable[Entry]) -> str:
    rows = sorted(
        (e for e in entries if (e.day.year, e.day.month) == (month.year, month.month)),
        key=lambda e: (e.day, e.account),
    )
    if not rows:
        return "%s\n(no entries)" % header(owner, month)
    body = "\n".join(entry_line(e) for e in rows)
    return "{}\n{}\n\n{}".format(header(owner, month), body, footer(rows))


if __name__ == "__main__":
    sample = [
        Entry(dt.date(2024, 3, 1), "checking", "Salary", 2450.0),
        Entry(dt.date(2024, 3, 2), "checking", "Rent", -950.0),
        Entry(dt.date(2024, 3, 9), "card", "Groceries", -84.35),
        Entry(dt.date(2024, 3, 15), "savings", "Transfer in", 300.0),
    ]
    print(statement("R. Alvarez", dt.date(2024, 3, 1), sample))
