"""E-commerce: customers and their orders; cancel, change, return, move.

Preconditions: only a pending order can be cancelled or changed (a shipped or delivered one is
"already shipped"); only a delivered order can be returned ("not delivered").
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from lopd.envs.toolworld.core import (
    CITIES,
    NAMES,
    P_OK,
    Domain,
    FieldIs,
    Ids,
    Instance,
    Param,
    Template,
    Ticket,
    Tool,
    ToolError,
    attempt,
    call,
    find_by_name,
    get_row,
    listing,
    ticket_tool,
)

PRODUCTS = ("lamp", "chair", "desk", "phone", "camera", "kettle", "watch", "bike")
# Statuses a generated order starts in ("returned" only arises from return_order).
STATUSES = ("pending", "shipped", "delivered", "cancelled")
REASONS = ("already_shipped", "not_delivered")
MAX_QUANTITY = 5


@dataclass
class Customer:
    customer_id: str
    name: str
    city: str


@dataclass
class Order:
    order_id: str
    customer_id: str
    product: str
    quantity: int
    status: str


@dataclass
class ShopDB:
    customers: dict[str, Customer]
    orders: dict[str, Order]
    tickets: dict[str, Ticket] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------
# Tools


def find_customer(db: ShopDB, name: str) -> dict:
    return asdict(find_by_name(db.customers, name, "customer"))


def list_orders(db: ShopDB, customer_id: str) -> list[dict]:
    get_row(db.customers, customer_id, "customer")
    rows = [o for o in db.orders.values() if o.customer_id == customer_id]
    return listing(rows, ("order_id", "product", "quantity", "status"))


def get_order(db: ShopDB, order_id: str) -> dict:
    return asdict(get_row(db.orders, order_id, "order"))


def _pending(order: Order, verb: str) -> None:
    if order.status in ("shipped", "delivered"):
        raise ToolError(f"order {order.order_id} is already shipped and cannot be {verb}")
    if order.status != "pending":
        raise ToolError(f"order {order.order_id} is already {order.status}")


def cancel_order(db: ShopDB, order_id: str) -> dict:
    order = get_row(db.orders, order_id, "order")
    _pending(order, "cancelled")
    order.status = "cancelled"
    return {"order_id": order_id, "status": order.status}


def change_quantity(db: ShopDB, order_id: str, quantity: int) -> dict:
    order = get_row(db.orders, order_id, "order")
    if not 1 <= quantity <= MAX_QUANTITY:
        raise ToolError(f"quantity must be between 1 and {MAX_QUANTITY}")
    _pending(order, "changed")
    order.quantity = quantity
    return {"order_id": order_id, "quantity": quantity}


def return_order(db: ShopDB, order_id: str) -> dict:
    order = get_row(db.orders, order_id, "order")
    if order.status in ("pending", "shipped"):
        raise ToolError(f"order {order_id} is not delivered and cannot be returned")
    if order.status != "delivered":
        raise ToolError(f"order {order_id} is already {order.status}")
    order.status = "returned"
    return {"order_id": order_id, "status": order.status}


def update_city(db: ShopDB, customer_id: str, city: str) -> dict:
    customer = get_row(db.customers, customer_id, "customer")
    customer.city = city
    return {"customer_id": customer_id, "city": city}


_ORDER_ID = Param("string", "order id")
_CUSTOMER_ID = Param("string", "customer id")
TOOLS = (
    Tool("find_customer", "Find a customer by name", {"name": Param("string", "first name")},
         find_customer),
    Tool("list_orders", "List a customer's orders", {"customer_id": _CUSTOMER_ID}, list_orders),
    Tool("get_order", "Look up an order", {"order_id": _ORDER_ID}, get_order),
    Tool("cancel_order", "Cancel a pending order", {"order_id": _ORDER_ID}, cancel_order),
    Tool("change_quantity", "Change a pending order's quantity",
         {"order_id": _ORDER_ID, "quantity": Param("integer", f"1 to {MAX_QUANTITY}")},
         change_quantity),
    Tool("return_order", "Return a delivered order", {"order_id": _ORDER_ID}, return_order),
    Tool("update_city", "Change a customer's city",
         {"customer_id": _CUSTOMER_ID, "city": Param("string", "new city", CITIES)}, update_city),
    ticket_tool("order_id", "order", "orders", REASONS),
)


# ----------------------------------------------------------------------------------------------
# Worlds


def _world(rng: random.Random, ids: Ids) -> tuple[ShopDB, Customer]:
    """Three or four customers with a few random orders each; returns the task's customer."""
    db = ShopDB({}, {})
    for name in rng.sample(NAMES, rng.randint(3, 4)):
        customer = Customer(ids.new("C"), name, rng.choice(CITIES))
        db.customers[customer.customer_id] = customer
        for _ in range(rng.randint(0, 2)):
            _add_order(db, ids, rng, customer.customer_id)
    return db, rng.choice(list(db.customers.values()))


def _add_order(db: ShopDB, ids: Ids, rng: random.Random, customer_id: str,
               status: str | None = None) -> Order:
    """A new order of a product this customer has not ordered yet, so products name orders."""
    taken = {o.product for o in db.orders.values() if o.customer_id == customer_id}
    product = rng.choice([p for p in PRODUCTS if p not in taken])
    order = Order(ids.new("O"), customer_id, product, rng.randint(1, MAX_QUANTITY),
                  status or rng.choice(STATUSES))
    db.orders[order.order_id] = order
    return order


def _ticket(order: Order, reason: str) -> tuple[dict, str, str]:
    return call("open_ticket", order_id=order.order_id, reason=reason), order.order_id, reason


def _pending_or_shipped(rng: random.Random) -> tuple[str, bool]:
    """Status of the order to cancel or change, and whether that fails."""
    if rng.random() < P_OK:
        return "pending", False
    return rng.choice(("shipped", "delivered")), True


def _cancel(rng: random.Random, ids: Ids, db: ShopDB, customer: Customer,
            instruction: Callable[[Order], str], lookups: list[dict]) -> Instance:
    status, fails = _pending_or_shipped(rng)
    order = _add_order(db, ids, rng, customer.customer_id, status)
    return attempt(instruction(order), db, lookups, call("cancel_order", order_id=order.order_id),
                   [FieldIs("orders", order.order_id, "status", "cancelled")],
                   _ticket(order, "already_shipped") if fails else None)


# ----------------------------------------------------------------------------------------------
# Templates


def cancel_order_tpl(rng: random.Random) -> Instance:
    ids = Ids(rng)
    db, c = _world(rng, ids)
    return _cancel(rng, ids, db, c,
                   lambda o: f"Cancel order {o.order_id} of customer {c.customer_id}.", [])


def cancel_by_product(rng: random.Random) -> Instance:
    ids = Ids(rng)
    db, c = _world(rng, ids)
    return _cancel(rng, ids, db, c,
                   lambda o: f"Cancel the {o.product} order of customer {c.customer_id}.",
                   [call("list_orders", customer_id=c.customer_id)])


def cancel_by_name(rng: random.Random) -> Instance:
    ids = Ids(rng)
    db, c = _world(rng, ids)
    return _cancel(rng, ids, db, c, lambda o: f"Cancel the {o.product} order of customer {c.name}.",
                   [call("find_customer", name=c.name),
                    call("list_orders", customer_id=c.customer_id)])


def change_quantity_tpl(rng: random.Random) -> Instance:
    ids = Ids(rng)
    db, c = _world(rng, ids)
    status, fails = _pending_or_shipped(rng)
    order = _add_order(db, ids, rng, c.customer_id, status)
    quantity = rng.choice([q for q in range(1, MAX_QUANTITY + 1) if q != order.quantity])
    return attempt(
        f"Change order {order.order_id} of customer {c.customer_id} to quantity {quantity}.", db,
        [], call("change_quantity", order_id=order.order_id, quantity=quantity),
        [FieldIs("orders", order.order_id, "quantity", quantity)],
        _ticket(order, "already_shipped") if fails else None)


def return_order_tpl(rng: random.Random) -> Instance:
    ids = Ids(rng)
    db, c = _world(rng, ids)
    fails = rng.random() >= P_OK
    order = _add_order(db, ids, rng, c.customer_id,
                       rng.choice(("pending", "shipped")) if fails else "delivered")
    return attempt(f"Return order {order.order_id} of customer {c.customer_id}.", db, [],
                   call("return_order", order_id=order.order_id),
                   [FieldIs("orders", order.order_id, "status", "returned")],
                   _ticket(order, "not_delivered") if fails else None)


def update_city_tpl(rng: random.Random) -> Instance:
    ids = Ids(rng)
    db, c = _world(rng, ids)
    city = rng.choice([x for x in CITIES if x != c.city])
    return attempt(f"Set the city of customer {c.customer_id} to {city}.", db, [],
                   call("update_city", customer_id=c.customer_id, city=city),
                   [FieldIs("customers", c.customer_id, "city", city)], None)


def update_city_by_name(rng: random.Random) -> Instance:
    ids = Ids(rng)
    db, c = _world(rng, ids)
    city = rng.choice([x for x in CITIES if x != c.city])
    return attempt(f"Set the city of customer {c.name} to {city}.", db,
                   [call("find_customer", name=c.name)],
                   call("update_city", customer_id=c.customer_id, city=city),
                   [FieldIs("customers", c.customer_id, "city", city)], None)


def _all_with_status(rng: random.Random, ids: Ids, db: ShopDB, c: Customer, status: str) -> list:
    """Ids of the one to three orders of ``c`` in ``status``; ``c`` has others too."""
    others = [s for s in STATUSES if s != status]
    mine = [o for o in db.orders.values() if o.customer_id == c.customer_id]
    for order in mine:  # the template decides how many orders match
        if order.status == status:
            order.status = rng.choice(others)
    if not mine:
        _add_order(db, ids, rng, c.customer_id, rng.choice(others))
    return sorted(_add_order(db, ids, rng, c.customer_id, status).order_id
                  for _ in range(rng.randint(1, 3)))


def return_all_delivered(rng: random.Random) -> Instance:
    ids = Ids(rng)
    db, c = _world(rng, ids)
    targets = _all_with_status(rng, ids, db, c, "delivered")
    return Instance(f"Return all delivered orders of customer {c.customer_id}.", db,
                    [call("list_orders", customer_id=c.customer_id)]
                    + [call("return_order", order_id=o) for o in targets],
                    [FieldIs("orders", o, "status", "returned") for o in targets], "ok")


def cancel_all_pending_by_name(rng: random.Random) -> Instance:
    ids = Ids(rng)
    db, c = _world(rng, ids)
    targets = _all_with_status(rng, ids, db, c, "pending")
    return Instance(f"Cancel all pending orders of customer {c.name}.", db,
                    [call("find_customer", name=c.name),
                     call("list_orders", customer_id=c.customer_id)]
                    + [call("cancel_order", order_id=o) for o in targets],
                    [FieldIs("orders", o, "status", "cancelled") for o in targets], "ok")


DOMAIN = Domain("ecommerce", "an e-commerce", TOOLS, (
    Template("cancel_order", 3, cancel_order_tpl),
    Template("change_quantity", 3, change_quantity_tpl),
    Template("return_order", 3, return_order_tpl),
    Template("update_city", 2, update_city_tpl),
    Template("update_city_by_name", 2, update_city_by_name),
    Template("cancel_by_product", 2, cancel_by_product),
    Template("cancel_by_name", 2, cancel_by_name),
    Template("return_all_delivered", 2, return_all_delivered),
    Template("cancel_all_pending_by_name", 1.5, cancel_all_pending_by_name),
))
