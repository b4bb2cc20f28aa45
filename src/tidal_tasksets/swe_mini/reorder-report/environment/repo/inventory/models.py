from dataclasses import dataclass


@dataclass
class Item:
    sku: str
    on_hand: int
    reorder_point: int
    reorder_qty: int
    discontinued: bool = False
