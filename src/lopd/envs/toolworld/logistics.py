"""Logistics: clients, their shipments and couriers; reroute, upgrade, hold, assign.

Preconditions: a delivered shipment cannot be rerouted or held ("already_delivered"); only a
shipment still at the depot can be upgraded or given a courier ("in_transit"); express has a
weight limit ("too_heavy"); a busy courier cannot be assigned ("courier_busy"); a city may have no
available courier ("no_courier").
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from lopd.envs.toolworld.core import (
    CITIES,
    NAMES,
    P_OK,
    Check,
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
    ticket_check,
    ticket_tool,
)

STATUSES = ("created", "in_transit", "on_hold", "delivered")
EXPRESS_LIMIT = 20  # kg
REASONS = ("already_delivered", "in_transit", "too_heavy", "courier_busy", "no_courier")


@dataclass
class Client:
    client_id: str
    name: str


@dataclass
class Shipment:
    shipment_id: str
    client_id: str
    city: str  # destination
    weight: int  # kg
    priority: str  # standard or express
    status: str
    courier_id: str  # "none" until assign_courier gives it one


@dataclass
class Courier:
    courier_id: str
    city: str
    status: str  # available or busy


@dataclass
class LogisticsDB:
    clients: dict[str, Client]
    shipments: dict[str, Shipment]
    couriers: dict[str, Courier]
    tickets: dict[str, Ticket] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------
# Tools


def find_client(db: LogisticsDB, name: str) -> dict:
    client = find_by_name(db.clients, name, "client")
    return {"client_id": client.client_id, "name": client.name}


def list_shipments(db: LogisticsDB, client_id: str) -> list[dict]:
    get_row(db.clients, client_id, "client")
    rows = [s for s in db.shipments.values() if s.client_id == client_id]
    return listing(rows, ("shipment_id", "city", "weight", "priority", "status"))


def list_couriers(db: LogisticsDB, city: str) -> list[dict]:
    rows = [c for c in db.couriers.values() if c.city == city and c.status == "available"]
    return listing(rows, ("courier_id",))


def _shipment(db: LogisticsDB, shipment_id: str, verb: str, allowed: tuple[str, ...]) -> Shipment:
    """The shipment, if its status allows it to be ``verb``; the error names the status."""
    shipment = get_row(db.shipments, shipment_id, "shipment")
    if shipment.status not in allowed:
        state = {"in_transit": "already in transit", "delivered": "already delivered",
                 "on_hold": "on hold", "created": "not in transit"}[shipment.status]
        raise ToolError(f"shipment {shipment_id} is {state} and cannot be {verb}")
    return shipment


def reroute_shipment(db: LogisticsDB, shipment_id: str, city: str) -> dict:
    shipment = _shipment(db, shipment_id, "rerouted", ("created", "in_transit", "on_hold"))
    if shipment.city == city:
        raise ToolError(f"shipment {shipment_id} already goes to {city}")
    shipment.city = city
    return {"shipment_id": shipment_id, "city": city}


def upgrade_shipment(db: LogisticsDB, shipment_id: str) -> dict:
    shipment = _shipment(db, shipment_id, "upgraded", ("created",))
    if shipment.priority == "express":
        raise ToolError(f"shipment {shipment_id} is already express")
    if shipment.weight > EXPRESS_LIMIT:
        raise ToolError(f"shipment {shipment_id} is too heavy for express "
                        f"({shipment.weight} kg, limit {EXPRESS_LIMIT})")
    shipment.priority = "express"
    return {"shipment_id": shipment_id, "priority": shipment.priority}


def hold_shipment(db: LogisticsDB, shipment_id: str) -> dict:
    shipment = _shipment(db, shipment_id, "held", ("in_transit",))
    shipment.status = "on_hold"
    return {"shipment_id": shipment_id, "status": shipment.status}


def assign_courier(db: LogisticsDB, shipment_id: str, courier_id: str) -> dict:
    courier = get_row(db.couriers, courier_id, "courier")
    shipment = _shipment(db, shipment_id, "assigned", ("created",))
    if courier.status != "available":
        raise ToolError(f"courier {courier_id} is busy")
    shipment.courier_id, shipment.status, courier.status = courier_id, "in_transit", "busy"
    return {"shipment_id": shipment_id, "courier_id": courier_id, "status": shipment.status}


_SHIPMENT_ID = Param("string", "shipment id")
TOOLS = (
    Tool("find_client", "Find a client by name", {"name": Param("string", "first name")},
         find_client),
    Tool("list_shipments", "List a client's shipments",
         {"client_id": Param("string", "client id")}, list_shipments),
    Tool("list_couriers", "List available couriers in a city",
         {"city": Param("string", "city", CITIES)}, list_couriers),
    Tool("reroute_shipment", "Send a shipment to another city",
         {"shipment_id": _SHIPMENT_ID, "city": Param("string", "new destination", CITIES)},
         reroute_shipment),
    Tool("upgrade_shipment", "Make a shipment express", {"shipment_id": _SHIPMENT_ID},
         upgrade_shipment),
    Tool("hold_shipment", "Put a shipment in transit on hold", {"shipment_id": _SHIPMENT_ID},
         hold_shipment),
    Tool("assign_courier", "Give a shipment to a courier",
         {"shipment_id": _SHIPMENT_ID, "courier_id": Param("string", "courier id")},
         assign_courier),
    ticket_tool("shipment_id", "shipment", "shipments", REASONS),
)


# ----------------------------------------------------------------------------------------------
# Worlds


def _world(rng: random.Random, ids: Ids) -> tuple[LogisticsDB, Client]:
    """Three or four clients with a few shipments and three couriers; returns the task's client."""
    db = LogisticsDB({}, {}, {})
    for name in rng.sample(NAMES, rng.randint(3, 4)):
        client = Client(ids.new("C"), name)
        db.clients[client.client_id] = client
        for _ in range(rng.randint(0, 2)):
            _add_shipment(db, ids, rng, client, rng.choice(STATUSES))
    for _ in range(3):
        _add_courier(db, ids, rng, rng.choice(CITIES), rng.choice(("available", "busy")))
    return db, rng.choice(list(db.clients.values()))


def _add_shipment(db: LogisticsDB, ids: Ids, rng: random.Random, client: Client, status: str,
                  weight: int | None = None, priority: str | None = None) -> Shipment:
    """A shipment to a city this client does not ship to yet, so destinations name shipments."""
    taken = {s.city for s in db.shipments.values() if s.client_id == client.client_id}
    shipment = Shipment(ids.new("S"), client.client_id,
                        rng.choice([c for c in CITIES if c not in taken]),
                        weight or rng.randint(1, 30),
                        priority or rng.choice(("standard", "express")), status, "none")
    db.shipments[shipment.shipment_id] = shipment
    return shipment


def _add_courier(db: LogisticsDB, ids: Ids, rng: random.Random, city: str, status: str) -> Courier:
    courier = Courier(ids.new("K"), city, status)
    db.couriers[courier.courier_id] = courier
    return courier


def _ticket(shipment: Shipment, reason: str) -> tuple[dict, str, str]:
    return (call("open_ticket", shipment_id=shipment.shipment_id, reason=reason),
            shipment.shipment_id, reason)


def _reroute(rng: random.Random, ids: Ids, db: LogisticsDB, client: Client,
             lookups: list[dict], instruction: Callable[[Shipment, str], str]) -> Instance:
    fails = rng.random() >= P_OK
    shipment = _add_shipment(db, ids, rng, client,
                             "delivered" if fails else rng.choice(("created", "in_transit")))
    city = rng.choice([c for c in CITIES if c != shipment.city])
    return attempt(instruction(shipment, city), db, lookups,
                   call("reroute_shipment", shipment_id=shipment.shipment_id, city=city),
                   [FieldIs("shipments", shipment.shipment_id, "city", city)],
                   _ticket(shipment, "already_delivered") if fails else None)


def _upgrade(rng: random.Random, ids: Ids, db: LogisticsDB, client: Client,
             lookups: list[dict], instruction: Callable[[Shipment], str]) -> Instance:
    variant = rng.choices(("ok", "in_transit", "too_heavy"), (P_OK, 0.2, 0.2))[0]
    status = "in_transit" if variant == "in_transit" else "created"
    weight = (rng.randint(EXPRESS_LIMIT + 1, 30) if variant == "too_heavy"
              else rng.randint(1, EXPRESS_LIMIT))
    shipment = _add_shipment(db, ids, rng, client, status, weight, "standard")
    return attempt(instruction(shipment), db, lookups,
                   call("upgrade_shipment", shipment_id=shipment.shipment_id),
                   [FieldIs("shipments", shipment.shipment_id, "priority", "express")],
                   None if variant == "ok" else _ticket(shipment, variant))


def _assignment(shipment: Shipment, courier: Courier) -> list[Check]:
    return [FieldIs("shipments", shipment.shipment_id, "courier_id", courier.courier_id),
            FieldIs("shipments", shipment.shipment_id, "status", "in_transit"),
            FieldIs("couriers", courier.courier_id, "status", "busy")]


# ----------------------------------------------------------------------------------------------
# Templates


def reroute_tpl(rng: random.Random) -> Instance:
    ids = Ids(rng)
    db, c = _world(rng, ids)
    return _reroute(rng, ids, db, c, [], lambda s, city: (
        f"Reroute shipment {s.shipment_id} of client {c.client_id} to {city}."))


def reroute_by_name(rng: random.Random) -> Instance:
    ids = Ids(rng)
    db, c = _world(rng, ids)
    return _reroute(
        rng, ids, db, c,
        [call("find_client", name=c.name), call("list_shipments", client_id=c.client_id)],
        lambda s, city: f"Client {c.name} wants the shipment to {s.city} rerouted to {city}.")


def upgrade_tpl(rng: random.Random) -> Instance:
    ids = Ids(rng)
    db, c = _world(rng, ids)
    return _upgrade(rng, ids, db, c, [], lambda s: (
        f"Upgrade shipment {s.shipment_id} of client {c.client_id} to express."))


def upgrade_by_city(rng: random.Random) -> Instance:
    ids = Ids(rng)
    db, c = _world(rng, ids)
    return _upgrade(rng, ids, db, c, [call("list_shipments", client_id=c.client_id)], lambda s: (
        f"Upgrade the shipment to {s.city} of client {c.client_id} to express."))


def hold_tpl(rng: random.Random) -> Instance:
    ids = Ids(rng)
    db, c = _world(rng, ids)
    fails = rng.random() >= P_OK
    shipment = _add_shipment(db, ids, rng, c, "delivered" if fails else "in_transit")
    return attempt(f"Put shipment {shipment.shipment_id} of client {c.client_id} on hold.", db, [],
                   call("hold_shipment", shipment_id=shipment.shipment_id),
                   [FieldIs("shipments", shipment.shipment_id, "status", "on_hold")],
                   _ticket(shipment, "already_delivered") if fails else None)


def hold_all_by_name(rng: random.Random) -> Instance:
    ids = Ids(rng)
    db, c = _world(rng, ids)
    others = ("created", "on_hold", "delivered")
    mine = [s for s in db.shipments.values() if s.client_id == c.client_id]
    for shipment in mine:  # the template decides how many shipments match
        if shipment.status == "in_transit":
            shipment.status = rng.choice(others)
    if not mine:
        _add_shipment(db, ids, rng, c, rng.choice(others))
    targets = sorted(_add_shipment(db, ids, rng, c, "in_transit").shipment_id
                     for _ in range(rng.randint(1, 3)))
    return Instance(f"Put all in-transit shipments of client {c.name} on hold.", db,
                    [call("find_client", name=c.name),
                     call("list_shipments", client_id=c.client_id)]
                    + [call("hold_shipment", shipment_id=s) for s in targets],
                    [FieldIs("shipments", s, "status", "on_hold") for s in targets], "ok")


def assign_courier_tpl(rng: random.Random) -> Instance:
    ids = Ids(rng)
    db, c = _world(rng, ids)
    fails = rng.random() >= P_OK
    shipment = _add_shipment(db, ids, rng, c, "created")
    courier = _add_courier(db, ids, rng, rng.choice(CITIES), "busy" if fails else "available")
    return attempt(f"Assign courier {courier.courier_id} to shipment {shipment.shipment_id}.", db,
                   [], call("assign_courier", shipment_id=shipment.shipment_id,
                            courier_id=courier.courier_id),
                   _assignment(shipment, courier),
                   _ticket(shipment, "courier_busy") if fails else None)


def assign_in_city(rng: random.Random) -> Instance:
    """The oracle lists the city's available couriers: one to assign, or none to report."""
    ids = Ids(rng)
    db, c = _world(rng, ids)
    shipment = _add_shipment(db, ids, rng, c, "created")
    city = rng.choice(CITIES)
    for courier in db.couriers.values():
        if courier.city == city:
            courier.status = "busy"
    instruction = f"Assign an available courier in {city} to shipment {shipment.shipment_id}."
    lookup = call("list_couriers", city=city)
    if rng.random() < P_OK:
        courier = _add_courier(db, ids, rng, city, "available")
        return Instance(instruction, db, [lookup, call(
            "assign_courier", shipment_id=shipment.shipment_id, courier_id=courier.courier_id)],
            _assignment(shipment, courier), "ok")
    if rng.random() < 0.5:
        _add_courier(db, ids, rng, city, "busy")
    ticket, target, reason = _ticket(shipment, "no_courier")
    return Instance(instruction, db, [lookup, ticket],
                    [FieldIs("shipments", shipment.shipment_id, "status", "created"),
                     ticket_check(target, reason)], reason)


DOMAIN = Domain("logistics", "a logistics", TOOLS, (
    Template("reroute", 3, reroute_tpl),
    Template("upgrade", 3, upgrade_tpl),
    Template("hold", 3, hold_tpl),
    Template("assign_courier", 3, assign_courier_tpl),
    Template("assign_in_city", 2, assign_in_city),
    Template("upgrade_by_city", 2, upgrade_by_city),
    Template("reroute_by_name", 2, reroute_by_name),
    Template("hold_all_by_name", 1.5, hold_all_by_name),
))
