"""A small in-memory inventory for a corner shop."""

from dataclasses import dataclass, field
from typing import Dict, List, Optional


@dataclass
class StockItem:
    sku: str
    name: str
    price_cents: int
    quantity: int = 0
    tags: List[str] = field(default_factory=list)

    def value_cents(self) -> int:
        return self.price_cents * self.quantity


class Inventory:
    def __init__(self) -> None:
        self._items: Dict[str, StockItem] = {}

    def add(self, item: StockItem) -> None:
        if item.sku in self._items:
            raise KeyError(f"duplicate sku {item.sku}")
        self._items[item.sku] = item

    def get(self, sku: str) -> Optional[StockItem]:
        return self._items.get(sku)

    def restock(self, sku: str, amount: int) -> StockItem:
        item = self._items[sku]
        item.quantity += amount
        return item

    def sell(self, sku: str, amount: int = 1) -> StockItem:
        item = self._items[sku]
        if item.quantity < amount:
            raise ValueError(f"only {item.quantity} of {item.name} left")
        item.quantity -= amount
        return item

    def low_stock(self, threshold: int = 3) -> List[StockItem]:
        return sorted(
            (i for i in self._items.values() if i.quantity <= threshold),
            key=lambda i: (i.quantity, i.sku),
        )

    def total_value_cents(self) -> int:
        return sum(i.value_cents() for i in self._items.values())

    def by_tag(self, tag: str) -> List[StockItem]:
        return [i for i in self._items.values() if tag in i.tags]


def parse_line(line: str) -> StockItem:
    """Parse `sku;name;price;quantity;tag,tag` into a StockItem."""
    sku, name, price, quantity, tags = line.rstrip("\n").split(";")
    return StockItem(
        sku=sku,
        name=name,
        price_cents=round(float(price) * 100),
        quantity=int(quantity),
        tags=[t for t in tags.split(",") if t],
    )


def load(lines: List[str]) -> Inventory:
    inventory = Inventory()
    for line in lines:
        if line.strip() and not line.startswith("#"):
            inventory.add(parse_line(line))
    return inventory


def report(inventory: Inventory) -> str:
    rows = [f"{'sku':<8}{'name':<20}{'qty':>5}"]
    for item in inventory.low_stock():
        rows.append(f"{item.sku:<8}{item.name:<20}{item.quantity:>5}")
    return "\n".join(rows)
