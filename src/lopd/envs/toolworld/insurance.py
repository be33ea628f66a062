"""Insurance: holders, their policies and the claims on them; change plans, file, pay, cancel.

Preconditions: a lapsed policy cannot change plan or take claims ("policy_lapsed"); a claim
cannot exceed the plan's limit ("over_limit"); a policy with open claims cannot be cancelled
("open_claims"); only an open claim can be paid ("claim_closed").
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from lopd.envs.toolworld.core import (
    NAMES,
    P_OK,
    Domain,
    FieldIs,
    Ids,
    Instance,
    Param,
    RowAdded,
    Template,
    Ticket,
    Tool,
    ToolError,
    attempt,
    call,
    find_by_name,
    get_row,
    listing,
    next_id,
    ticket_tool,
)

KINDS = ("auto", "home", "travel", "pet", "life", "health")
PLANS = ("basic", "plus", "premium")
LIMITS = {"basic": 300, "plus": 600, "premium": 900}
AMOUNTS = tuple(range(100, 1000, 100))
CLAIM_STATUSES = ("open", "paid", "denied")
REASONS = ("policy_lapsed", "over_limit", "open_claims", "claim_closed")


@dataclass
class Holder:
    holder_id: str
    name: str


@dataclass
class Policy:
    policy_id: str
    holder_id: str
    kind: str
    plan: str
    status: str  # active, lapsed or cancelled


@dataclass
class Claim:
    claim_id: str
    policy_id: str
    amount: int
    status: str


@dataclass
class InsuranceDB:
    holders: dict[str, Holder]
    policies: dict[str, Policy]
    claims: dict[str, Claim]
    tickets: dict[str, Ticket] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------
# Tools


def find_holder(db: InsuranceDB, name: str) -> dict:
    holder = find_by_name(db.holders, name, "holder")
    return {"holder_id": holder.holder_id, "name": holder.name}


def list_policies(db: InsuranceDB, holder_id: str) -> list[dict]:
    get_row(db.holders, holder_id, "holder")
    rows = [p for p in db.policies.values() if p.holder_id == holder_id]
    return listing(rows, ("policy_id", "kind", "plan", "status"))


def list_claims(db: InsuranceDB, policy_id: str) -> list[dict]:
    get_row(db.policies, policy_id, "policy")
    rows = [c for c in db.claims.values() if c.policy_id == policy_id]
    return listing(rows, ("claim_id", "amount", "status"))


def _active(policy: Policy, verb: str) -> None:
    if policy.status != "active":
        raise ToolError(f"policy {policy.policy_id} is {policy.status} and cannot {verb}")


def change_plan(db: InsuranceDB, policy_id: str, plan: str) -> dict:
    policy = get_row(db.policies, policy_id, "policy")
    _active(policy, "be changed")
    if policy.plan == plan:
        raise ToolError(f"policy {policy_id} is already on the {plan} plan")
    policy.plan = plan
    return {"policy_id": policy_id, "plan": plan}


def file_claim(db: InsuranceDB, policy_id: str, amount: int) -> dict:
    policy = get_row(db.policies, policy_id, "policy")
    _active(policy, "take claims")
    limit = LIMITS[policy.plan]
    if amount < 1:
        raise ToolError("amount must be positive")
    if amount > limit:
        raise ToolError(f"amount {amount} is over the {limit} limit of policy {policy_id}")
    claim = Claim(next_id(db.claims, "L"), policy_id, amount, "open")
    db.claims[claim.claim_id] = claim
    return {"claim_id": claim.claim_id, "policy_id": policy_id, "amount": amount,
            "status": claim.status}


def pay_claim(db: InsuranceDB, claim_id: str) -> dict:
    claim = get_row(db.claims, claim_id, "claim")
    if claim.status != "open":
        raise ToolError(f"claim {claim_id} is already closed and cannot be paid")
    claim.status = "paid"
    return {"claim_id": claim_id, "status": claim.status}


def cancel_policy(db: InsuranceDB, policy_id: str) -> dict:
    policy = get_row(db.policies, policy_id, "policy")
    if policy.status == "cancelled":
        raise ToolError(f"policy {policy_id} is already cancelled")
    if any(c.policy_id == policy_id and c.status == "open" for c in db.claims.values()):
        raise ToolError(f"policy {policy_id} has open claims and cannot be cancelled")
    policy.status = "cancelled"
    return {"policy_id": policy_id, "status": policy.status}


_POLICY_ID = Param("string", "policy id")
TOOLS = (
    Tool("find_holder", "Find a holder by name", {"name": Param("string", "first name")},
         find_holder),
    Tool("list_policies", "List a holder's policies",
         {"holder_id": Param("string", "holder id")}, list_policies),
    Tool("list_claims", "List a policy's claims", {"policy_id": _POLICY_ID}, list_claims),
    Tool("change_plan", "Change an active policy's plan",
         {"policy_id": _POLICY_ID, "plan": Param("string", "new plan", PLANS)}, change_plan),
    Tool("file_claim", "File a claim on an active policy",
         {"policy_id": _POLICY_ID, "amount": Param("integer", "claim amount")}, file_claim),
    Tool("pay_claim", "Pay an open claim", {"claim_id": Param("string", "claim id")}, pay_claim),
    Tool("cancel_policy", "Cancel a policy", {"policy_id": _POLICY_ID}, cancel_policy),
    ticket_tool("policy_id", "policy", "policies", REASONS),
)


# ----------------------------------------------------------------------------------------------
# Worlds


def _world(rng: random.Random, ids: Ids) -> tuple[InsuranceDB, Holder]:
    """Three or four holders with one or two policies and a few claims; returns the task's
    holder."""
    db = InsuranceDB({}, {}, {})
    for name in rng.sample(NAMES, rng.randint(3, 4)):
        holder = Holder(ids.new("H"), name)
        db.holders[holder.holder_id] = holder
        for _ in range(rng.randint(0, 2)):
            policy = _add_policy(db, ids, rng, holder, rng.choice(("active", "active", "lapsed")))
            for _ in range(rng.randint(0, 1)):
                _add_claim(db, ids, rng, policy, rng.choice(CLAIM_STATUSES))
    return db, rng.choice(list(db.holders.values()))


def _add_policy(db: InsuranceDB, ids: Ids, rng: random.Random, holder: Holder, status: str,
                plans: tuple[str, ...] = PLANS) -> Policy:
    """A policy of a kind this holder does not have yet, so kinds name policies."""
    taken = {p.kind for p in db.policies.values() if p.holder_id == holder.holder_id}
    kind = rng.choice([k for k in KINDS if k not in taken])
    policy = Policy(ids.new("P"), holder.holder_id, kind, rng.choice(plans), status)
    db.policies[policy.policy_id] = policy
    return policy


def _add_claim(db: InsuranceDB, ids: Ids, rng: random.Random, policy: Policy,
               status: str) -> Claim:
    claim = Claim(ids.new("L"), policy.policy_id, rng.choice(AMOUNTS[:6]), status)
    db.claims[claim.claim_id] = claim
    return claim


def _ticket(policy: Policy, reason: str) -> tuple[dict, str, str]:
    return call("open_ticket", policy_id=policy.policy_id, reason=reason), policy.policy_id, reason


def _change_plan(rng: random.Random, ids: Ids, db: InsuranceDB, holder: Holder,
                 lookups: list[dict], instruction: Callable[..., str]) -> Instance:
    fails = rng.random() >= P_OK
    policy = _add_policy(db, ids, rng, holder, "lapsed" if fails else "active")
    plan = rng.choice([p for p in PLANS if p != policy.plan])
    return attempt(instruction(policy, plan), db, lookups,
                   call("change_plan", policy_id=policy.policy_id, plan=plan),
                   [FieldIs("policies", policy.policy_id, "plan", plan)],
                   _ticket(policy, "policy_lapsed") if fails else None)


def _file_claim(rng: random.Random, ids: Ids, db: InsuranceDB, holder: Holder,
                lookups: list[dict], instruction: Callable[..., str]) -> Instance:
    variant = rng.choices(("ok", "policy_lapsed", "over_limit"), (P_OK, 0.2, 0.2))[0]
    if variant == "over_limit":
        policy = _add_policy(db, ids, rng, holder, "active", ("basic", "plus"))
        amount = rng.choice([a for a in AMOUNTS if a > LIMITS[policy.plan]])
    else:
        policy = _add_policy(db, ids, rng, holder, "lapsed" if variant != "ok" else "active")
        amount = rng.choice([a for a in AMOUNTS if a <= LIMITS[policy.plan]])
    new_claim = RowAdded("claims", (("policy_id", policy.policy_id), ("amount", amount),
                                    ("status", "open")))
    return attempt(instruction(policy, amount), db, lookups,
                   call("file_claim", policy_id=policy.policy_id, amount=amount), [new_claim],
                   None if variant == "ok" else _ticket(policy, variant))


def _cancel_policy(rng: random.Random, ids: Ids, db: InsuranceDB, holder: Holder,
                   lookups: list[dict], instruction: Callable[..., str]) -> Instance:
    fails = rng.random() >= P_OK
    policy = _add_policy(db, ids, rng, holder, rng.choice(("active", "lapsed")))
    for _ in range(rng.randint(1, 2) if fails else rng.randint(0, 1)):
        _add_claim(db, ids, rng, policy, "open" if fails else rng.choice(("paid", "denied")))
    return attempt(instruction(policy), db, lookups,
                   call("cancel_policy", policy_id=policy.policy_id),
                   [FieldIs("policies", policy.policy_id, "status", "cancelled")],
                   _ticket(policy, "open_claims") if fails else None)


# ----------------------------------------------------------------------------------------------
# Templates


def change_plan_tpl(rng: random.Random) -> Instance:
    ids = Ids(rng)
    db, h = _world(rng, ids)
    return _change_plan(rng, ids, db, h, [], lambda p, plan: (
        f"Move policy {p.policy_id} of holder {h.holder_id} to the {plan} plan."))


def change_plan_by_name(rng: random.Random) -> Instance:
    ids = Ids(rng)
    db, h = _world(rng, ids)
    return _change_plan(
        rng, ids, db, h,
        [call("find_holder", name=h.name), call("list_policies", holder_id=h.holder_id)],
        lambda p, plan: f"Move the {p.kind} policy of holder {h.name} to the {plan} plan.")


def file_claim_tpl(rng: random.Random) -> Instance:
    ids = Ids(rng)
    db, h = _world(rng, ids)
    return _file_claim(rng, ids, db, h, [], lambda p, amount: (
        f"File a claim of {amount} on policy {p.policy_id} of holder {h.holder_id}."))


def file_claim_by_kind(rng: random.Random) -> Instance:
    ids = Ids(rng)
    db, h = _world(rng, ids)
    return _file_claim(rng, ids, db, h, [call("list_policies", holder_id=h.holder_id)],
                       lambda p, amount: (
                           f"File a claim of {amount} on the {p.kind} policy of holder "
                           f"{h.holder_id}."))


def cancel_policy_tpl(rng: random.Random) -> Instance:
    ids = Ids(rng)
    db, h = _world(rng, ids)
    return _cancel_policy(rng, ids, db, h, [], lambda p: (
        f"Cancel policy {p.policy_id} of holder {h.holder_id}."))


def cancel_policy_by_name(rng: random.Random) -> Instance:
    ids = Ids(rng)
    db, h = _world(rng, ids)
    return _cancel_policy(
        rng, ids, db, h,
        [call("find_holder", name=h.name), call("list_policies", holder_id=h.holder_id)],
        lambda p: f"Cancel the {p.kind} policy of holder {h.name}.")


def pay_claim_tpl(rng: random.Random) -> Instance:
    ids = Ids(rng)
    db, h = _world(rng, ids)
    policy = _add_policy(db, ids, rng, h, "active")
    fails = rng.random() >= P_OK
    claim = _add_claim(db, ids, rng, policy, rng.choice(("paid", "denied")) if fails else "open")
    return attempt(f"Pay claim {claim.claim_id} on policy {policy.policy_id}.", db, [],
                   call("pay_claim", claim_id=claim.claim_id),
                   [FieldIs("claims", claim.claim_id, "status", "paid")],
                   _ticket(policy, "claim_closed") if fails else None)


def pay_open_claims_by_kind(rng: random.Random) -> Instance:
    ids = Ids(rng)
    db, h = _world(rng, ids)
    policy = _add_policy(db, ids, rng, h, "active")
    targets = [_add_claim(db, ids, rng, policy, "open").claim_id for _ in range(rng.randint(1, 3))]
    _add_claim(db, ids, rng, policy, rng.choice(("paid", "denied")))
    return Instance(f"Pay all open claims on the {policy.kind} policy of holder {h.holder_id}.", db,
                    [call("list_policies", holder_id=h.holder_id),
                     call("list_claims", policy_id=policy.policy_id)]
                    + [call("pay_claim", claim_id=c) for c in sorted(targets)],
                    [FieldIs("claims", c, "status", "paid") for c in sorted(targets)], "ok")


DOMAIN = Domain("insurance", "an insurance", TOOLS, (
    Template("change_plan", 3, change_plan_tpl),
    Template("file_claim", 3, file_claim_tpl),
    Template("cancel_policy", 3, cancel_policy_tpl),
    Template("pay_claim", 3, pay_claim_tpl),
    Template("file_claim_by_kind", 2, file_claim_by_kind),
    Template("change_plan_by_name", 2, change_plan_by_name),
    Template("cancel_policy_by_name", 2, cancel_policy_by_name),
    Template("pay_open_claims_by_kind", 1.5, pay_open_claims_by_kind),
))
