"""toolworld: oracle replay, junk answers, split hygiene, determinism and hand-checked rewards."""

import json

import pytest

from lopd.chat import FINAL_MARKER, FinalAnswer, Malformed, ToolCall
from lopd.envs import get_env
from lopd.envs.environment import Task
from lopd.envs.toolworld import DEFAULT_SIZES, DOMAINS, ToolWorld, instance_key, system_prompt


@pytest.fixture(scope="module")
def env():
    return ToolWorld(seed=0)


def run_oracle(env, task):
    episode = env.reset(task)
    for action in task.oracle:
        result = episode.step(ToolCall(action["name"], action["arguments"]) if "name" in action
                              else FinalAnswer(action["answer"]))
    return episode, result


def find(env, domain, template, variant, split="train"):
    return next(t for t in env.tasks(split) if t.domain == domain and t.meta["template"] == template
                and t.meta["variant"] == variant)


def test_default_sizes_ids_and_domain_balance(env):
    for split, size in DEFAULT_SIZES.items():
        tasks = env.tasks(split)
        assert len(tasks) == size
        assert [t.task_id for t in tasks[:2]] == [f"toolworld/ecommerce/{split}/00000",
                                                  f"toolworld/insurance/{split}/00001"]
        counts = env.stats(split)["domains"]
        assert set(counts) == set(DOMAINS) and max(counts.values()) - min(counts.values()) <= 1
    assert DEFAULT_SIZES == {"pretrain": 30_000, "train": 2_349, "eval": 200}


def test_no_template_is_held_out(env):
    every = {f"{name}/{t.name}" for name, d in DOMAINS.items() for t in d.templates}
    for split in env.splits:
        assert set(env.stats(split)["templates"]) == every


def test_splits_share_no_instance(env):
    keys = {split: [instance_key(t) for t in env.tasks(split)] for split in env.splits}
    for split, split_keys in keys.items():
        assert len(set(split_keys)) == len(split_keys), split
    assert not set(keys["train"]) & set(keys["eval"])
    assert not set(keys["pretrain"]) & set(keys["eval"])
    assert not set(keys["pretrain"]) & set(keys["train"])


def test_oracle_solves_every_train_and_eval_task_and_a_pretrain_sample(env):
    tasks = env.tasks("train") + env.tasks("eval") + env.tasks("pretrain")[::30]
    for task in tasks:
        episode, result = run_oracle(env, task)
        assert result.done and result.observation is None
        assert result.reward == 1.0 and result.info["success"], (task.task_id, episode.verify())
    counts = env.stats("train")["oracle_calls"]
    assert set(counts) == {1, 2, 3, 4, 5}
    assert counts[1] + counts[2] > len(env.tasks("train")) / 2     # many easy tasks


def test_task_completed_alone_never_succeeds(env):
    for task in env.tasks("train") + env.tasks("eval"):
        result = env.reset(task).step(FinalAnswer(FINAL_MARKER))
        assert result.done and not result.info["success"] and result.reward < 1.0, task.task_id


def test_same_seed_same_tasks_and_smaller_sizes_give_prefixes():
    sizes = {"pretrain": 300, "train": 200, "eval": 50}
    a, b = ToolWorld(seed=0, sizes=sizes), ToolWorld(seed=0, sizes=sizes)
    for split in a.splits:
        assert a.tasks(split) == b.tasks(split)
    smaller = ToolWorld(seed=0, sizes={"pretrain": 100, "train": 20, "eval": 50})
    assert smaller.tasks("train") == a.tasks("train")[:20]
    other = ToolWorld(seed=1, sizes=sizes)
    assert [t.instruction for t in other.tasks("eval")] != [t.instruction for t in a.tasks("eval")]


def test_tasks_survive_a_jsonl_round_trip(env):
    for task in env.tasks("eval")[:40]:
        reloaded = Task.from_dict(json.loads(json.dumps(task.to_dict())))
        assert run_oracle(env, reloaded)[1].reward == 1.0
    tampered = Task.from_dict({**env.tasks("eval")[0].to_dict(), "instruction": "Do something."})
    with pytest.raises(ValueError, match="does not match"):
        env.reset(tampered)


def test_precondition_failure_is_an_error_observation_and_changes_nothing(env):
    task = find(env, "ecommerce", "cancel_order", "already_shipped")
    order_id = task.oracle[0]["arguments"]["order_id"]
    episode = env.reset(task)
    result = episode.step(ToolCall("cancel_order", {"order_id": order_id}))
    assert result.observation.startswith(f"Error: order {order_id} is already shipped")
    assert not result.done and result.reward == 0.0
    assert episode.db.orders[order_id].status in ("shipped", "delivered")


def test_bad_calls_and_malformed_actions_become_error_observations(env):
    episode = env.reset(find(env, "ecommerce", "cancel_order", "ok"))
    for action, expected in [
        (ToolCall("launch_rocket", {}), "Error: unknown tool launch_rocket"),
        (ToolCall("cancel_order", {}), "Error: missing argument 'order_id' for cancel_order"),
        (ToolCall("cancel_order", {"order_id": "O999", "x": 1}), "Error: unexpected argument"),
        (ToolCall("cancel_order", {"order_id": 482}), "Error: order_id must be a string"),
        (ToolCall("cancel_order", {"order_id": "O999"}), "Error: no order O999"),
        (ToolCall("change_quantity", {"order_id": "O999", "quantity": "2"}),
         "Error: quantity must be an integer"),
        (ToolCall("update_city", {"customer_id": "C100", "city": "Atlantis"}),
         "Error: city must be one of Paris"),
        (Malformed("<tool_call>{oops", "tool call is not valid JSON"),
         "Error: tool call is not valid JSON"),
    ]:
        result = episode.step(action)
        assert result.observation.startswith(expected) and not result.done and result.reward == 0


def test_steps_after_the_end_repeat_the_end(env):
    episode, final = run_oracle(env, env.tasks("eval")[0])
    again = episode.step(ToolCall("get_order", {"order_id": "O100"}))
    assert again.done and again.observation is None and again.reward == final.reward == 1.0


def test_partial_rewards_are_fractions_of_the_checklist(env):
    # cancel_order: [order cancelled, nothing else changed]; doing nothing keeps the second.
    task = find(env, "ecommerce", "cancel_order", "ok")
    assert env.reset(task).step(FinalAnswer(FINAL_MARKER)).reward == 0.5
    # Cancelling another pending order instead breaks both checks.
    for task in env.tasks("train"):
        if task.meta["template"] == "cancel_order" and task.meta["variant"] == "ok":
            episode = env.reset(task)
            target = task.oracle[0]["arguments"]["order_id"]
            decoys = [k for k, o in episode.db.orders.items() if k != target
                      and o.status == "pending"]
            if decoys:
                break
    episode.step(ToolCall("cancel_order", {"order_id": decoys[0]}))
    assert episode.step(FinalAnswer(FINAL_MARKER)).reward == 0.0

    # A report with the wrong reason: [order unchanged, right ticket, nothing else] -> 1/3.
    task = find(env, "ecommerce", "cancel_order", "already_shipped")
    episode = env.reset(task)
    order_id = task.oracle[0]["arguments"]["order_id"]
    episode.step(ToolCall("open_ticket", {"order_id": order_id, "reason": "not_delivered"}))
    verdict = episode.verify()
    assert [ok for _, ok in verdict.checks] == [True, False, False]
    assert verdict.reward == pytest.approx(1 / 3) and not verdict.success

    # An "all" task with two targets, one done: [first, second, nothing else] -> 2/3.
    task = next(t for t in env.tasks("train") if t.meta["template"] == "cancel_all_booked"
                and len(t.oracle) == 4)
    episode = env.reset(task)
    episode.step(ToolCall(task.oracle[1]["name"], task.oracle[1]["arguments"]))
    assert episode.step(FinalAnswer(FINAL_MARKER)).reward == pytest.approx(2 / 3)


def test_messages_are_a_short_system_prompt_and_the_instruction(env):
    for name in DOMAINS:
        task = next(t for t in env.tasks("eval") if t.domain == name)
        system, user = env.reset(task).messages()
        assert system == {"role": "system", "content": system_prompt(DOMAINS[name])}
        assert len(system["content"]) < 160 and "open_ticket" not in system["content"]
        assert user == {"role": "user", "content": task.instruction}
        assert task.instruction.count(".") == 1 and len(task.instruction) < 80


def test_tool_schemas_and_oracle_arguments_agree(env):
    for task in env.tasks("eval"):
        schemas = {t["function"]["name"]: t["function"] for t in task.tools}
        assert 5 <= len(schemas) <= 8 and "open_ticket" in schemas
        for schema in schemas.values():
            assert schema["parameters"]["required"] == list(schema["parameters"]["properties"])
        for action in task.oracle[:-1]:
            properties = schemas[action["name"]]["parameters"]["properties"]
            assert set(action["arguments"]) == set(properties)
            for key, value in action["arguments"].items():
                assert isinstance(value, int if properties[key]["type"] == "integer" else str)
        assert task.oracle[-1] == {"answer": FINAL_MARKER}


def test_transcripts_replay_the_oracle_with_real_observations(env):
    transcripts = env.transcripts("eval", n=5)
    assert len(transcripts) == 5 and env.transcripts(env.tasks("eval")[:5]) == transcripts
    for task, messages in zip(env.tasks("eval"), transcripts):
        assert [m["role"] for m in messages[:2]] == ["system", "user"]
        assert [m["role"] for m in messages[2:-1]] == ["assistant", "tool"] * (len(task.oracle) - 1)
        assert messages[-1] == {"role": "assistant", "content": FINAL_MARKER}
        assert [m["content"] for m in messages[2::2]] == task.oracle_texts()
        episode = env.reset(task)
        for call, tool in zip(task.oracle, messages[3::2]):
            if "name" in call:
                assert episode.step(ToolCall(call["name"], call["arguments"])).observation \
                    == tool["content"]


def test_registry():
    env = get_env("toolworld", seed=3, sizes={"pretrain": 4, "train": 4, "eval": 4})
    assert isinstance(env, ToolWorld) and len(env.tasks("train")) == 4
    with pytest.raises(ValueError, match="toolworld"):
        get_env("no-such-env")
    with pytest.raises(ValueError, match="unknown toolworld split"):
        ToolWorld(sizes={"test": 5})


# ----------------------------------------------------------------------------------------------
# Coded requests


def test_coded_requests_keep_only_ids_and_names():
    from lopd.envs.toolworld import coded_request, request_parts
    assert coded_request("Cancel order O482 of customer C384.", "cedar") == \
        "Request cedar: O482, C384."
    assert coded_request("Change order O810 of customer C682 to quantity 5.", "glacier") == \
        "Request glacier: O810, C682."
    assert request_parts("Change order O810 of customer C682 to quantity 5.") == \
        (["O810", "C682"], ("5",))
    assert coded_request("Book patient Lena with a dermatology doctor on thu.", "jasper") == \
        "Request jasper: Lena."
    assert request_parts("Client Max wants the shipment to Dublin rerouted to Cairo.") == \
        (["Max"], ("Dublin", "Cairo"))


def test_coded_splits_have_the_same_tasks_and_one_code_per_template_outside_pretraining():
    from lopd.envs.toolworld import request_parts, template_codes
    sizes = {"pretrain": 300, "train": 400, "eval": 100}
    plain, coded = ToolWorld(seed=0, sizes=sizes), ToolWorld(seed=0, sizes=sizes, coded_fraction=0.5)
    codes = template_codes(0)
    assert len(set(codes.values())) == len(codes) == sum(len(d.templates) for d in DOMAINS.values())
    assert template_codes(1) != codes                      # the codes belong to the world's seed
    # Pre-training codes are drawn per task: a code there says nothing about the template.
    pre = [t for t in coded.tasks("pretrain") if "code" in t.meta]
    assert 0.1 * 300 < len(pre) < 0.4 * 300
    meanings = {}
    for t in pre:
        meanings.setdefault(t.meta["code"], set()).add(t.meta["template"])
    assert max(len(m) for m in meanings.values()) > 1
    assert [(t.task_id, t.oracle) for t in coded.tasks("pretrain")] == \
        [(t.task_id, t.oracle) for t in plain.tasks("pretrain")]
    for split in ("train", "eval"):
        n_coded = 0
        for p, c in zip(plain.tasks(split), coded.tasks(split), strict=True):
            assert (p.task_id, p.meta["seed"], p.oracle) == (c.task_id, c.meta["seed"], c.oracle)
            assert instance_key(p) == instance_key(c)
            if "code" in c.meta:
                n_coded += 1
                name = f"{c.domain}/{c.meta['template']}"
                assert c.meta["code"] == codes[name]
                # a code stands for its template and one set of the left-out values
                assert request_parts(p.instruction)[1] == coded.code_values[name]
                assert c.instruction.startswith(f"Request {c.meta['code']}: ")
                assert c.meta["plain_instruction"] == p.instruction
                # Every id of the plain request is still there; its verb is not.
                ids = [w for w in p.instruction.rstrip(".").split() if w[1:].isdigit()]
                assert all(i in c.instruction for i in ids)
                assert p.instruction.split()[0] not in c.instruction
            else:
                assert c == p
        assert 0.15 * len(plain.tasks(split)) < n_coded < 0.4 * len(plain.tasks(split))
        assert coded.stats(split)["coded"] == n_coded
    # The oracle still solves every coded task, and reset rebuilds the coded request.
    for task in coded.tasks("train") + coded.tasks("eval"):
        episode, result = run_oracle(coded, task)
        assert result.reward == 1.0, task.task_id
        assert episode.messages()[1]["content"] == task.instruction
    full = ToolWorld(seed=0, sizes=sizes, coded_fraction=1.0)
    assert all(("code" in t.meta) == (request_parts(t.meta.get("plain_instruction", t.instruction))[1]
                                      == full.code_values[f"{t.domain}/{t.meta['template']}"])
               for t in full.tasks("eval"))
    with pytest.raises(ValueError, match="coded_fraction"):
        ToolWorld(seed=0, coded_fraction=1.5)


def test_coded_fraction_reaches_toolworld_through_the_config():
    from lopd.config import load_config
    cfg = load_config("tiny", ["env.coded_fraction=0.5", "env.train_size=10", "env.eval_size=4",
                               "env.pretrain_size=5"])
    env = get_env(cfg.env.name, **cfg.env.kwargs())
    assert env.coded_fraction == 0.5
    assert load_config("tiny").env.kwargs()["coded_fraction"] == 1.0      # the preset's setting
    assert "coded_fraction" not in load_config("tiny", ["env.coded_fraction=0"]).env.kwargs()
