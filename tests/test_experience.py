"""The experience bank: storage rules, atomic adds, exact cosine search, leave-one-out, the CLI."""

import json
from dataclasses import replace

import faiss
import numpy as np
import pytest
import torch

from lopd import agent, experience, policies
from lopd.cli import main
from lopd.embedding import EmbedderSpec, TransformersEmbedder, load_embedder
from lopd.envs.toolworld import ToolWorld
from lopd.experience import BankError, Experience, ExperienceBank, retrieval_quality

faiss.omp_set_num_threads(1)

SPEC = EmbedderSpec(kind="policy", path="test-tiny")


@pytest.fixture(scope="module")
def env():
    return ToolWorld(seed=0, sizes={"train": 40, "eval": 12, "pretrain": 0})


@pytest.fixture(scope="module")
def embedder(tiny_model, tiny_tokenizer):
    """The policy-model embedder on the random tiny test model: fast, and distinct per text."""
    return TransformersEmbedder(SPEC, tiny_model, tiny_tokenizer, batch_size=8)


@pytest.fixture(scope="module")
def entries(env, tiny_tokenizer):
    """Experiences of oracle rollouts (reward 1) of every training task."""
    tasks = env.tasks("train")
    rollouts = agent.run_episodes(env, tasks, policies.OraclePolicy(), tiny_tokenizer, max_turns=8,
                                  max_new_tokens=96, batch_size=16)
    assert all(r.reward == 1.0 for r in rollouts)
    return [Experience.from_rollout(r, t, source="oracle") for r, t in zip(rollouts, tasks)]


@pytest.fixture
def bank(tmp_path, embedder, entries):
    bank = ExperienceBank.create(tmp_path / "bank", embedder)
    assert len(bank.add(entries).added) == len(entries)
    yield bank
    bank.close()


def _as_lists(results):
    return [[(h.entry.entry_id, h.score) for h in hits] for hits in results]


def test_entries_come_from_compact_traces(entries, env):
    entry, task = entries[0], env.tasks("train")[0]
    assert entry.split == "train" and entry.env == "toolworld"
    assert entry.meta["template"] == task.meta["template"]
    assert entry.trace.splitlines()[0] == f"Task: {task.instruction}"
    assert len(entry.trace.splitlines()) == len(task.oracle) + 1   # one line per action


def _brute_force(queries, documents, doc_task_ids, exclude, n):
    """Top-n (ids into ``documents``, scores) per query row by numpy inner product, each query's
    ``exclude`` task left out."""
    results = []
    for row, excluded in zip(queries @ documents.T, exclude):
        eligible = [i for i in np.argsort(-row, kind="stable") if doc_task_ids[i] != excluded]
        results.append(([int(i) for i in eligible[:n]], row[eligible[:n]]))
    return results


def test_search_equals_a_numpy_brute_force_over_the_asymmetric_vectors(tmp_path, embedder,
                                                                       entries, env):
    """Queries go through embed_queries (with the query instruction), documents through
    embed_documents; leave-one-out drops the query task's own entries, however many."""
    asymmetric = TransformersEmbedder(replace(SPEC, query_instruction="Find a solved task: "),
                                      embedder.backbone, embedder.tokenizer, batch_size=8)
    # Task 0 and 1 get three more entries each, so their own entries would fill a top-3.
    extra = [replace(entries[k], trace=entries[k].trace + f"\n(retry {i})")
             for k in (0, 1) for i in range(3)]
    with ExperienceBank.create(tmp_path / "bank", asymmetric) as bank:
        bank.add(entries + extra)
        stored = bank.entries
        documents = asymmetric.embed_documents([e.trace for e in stored])
        np.testing.assert_allclose(bank.embeddings(), documents, atol=1e-6)
        np.testing.assert_allclose(np.linalg.norm(documents, axis=1), 1.0, atol=1e-5)
        texts = ([e.task for e in entries[:12]] + [t.instruction for t in env.tasks("eval")]
                 + ["Cancel order O1 of customer C2."])
        exclude = [e.task_id for e in entries[:12]] + [None] * (len(texts) - 12)
        queries = asymmetric.embed_queries(texts)
        expected = _brute_force(queries, documents, [e.task_id for e in stored], exclude, 3)
        found = bank.search(texts, n_ret=3, exclude_task_ids=exclude)
    for hits, (order, scores), excluded in zip(found, expected, exclude):
        assert [h.entry.entry_id for h in hits] == [stored[i].entry_id for i in order]
        np.testing.assert_allclose([h.score for h in hits], scores, atol=1e-5)
        assert all(h.entry.task_id != excluded for h in hits)
    # The instruction matters: ranking by the document vectors of the query texts (a symmetric
    # search) gives other neighbours, so the comparison above pins the query path.
    symmetric = _brute_force(asymmetric.embed_documents(texts), documents,
                             [e.task_id for e in stored], exclude, 3)
    assert any(a[0] != b[0] for a, b in zip(symmetric, expected))
    assert np.abs(queries - asymmetric.embed_documents(texts)).max() > 1e-3


def test_leave_one_out_by_default(bank, embedder, entries):
    # Three more entries of task 0, so that its own entries would fill a whole top-3.
    extra = [replace(entries[0], trace=entries[0].trace + f"\n(retry {i})") for i in range(3)]
    bank.add(extra)
    own = entries[0].task_id
    queries = [e.task for e in entries]
    ids = [e.task_id for e in entries]
    for hits, task_id in zip(bank.search(queries, n_ret=3, exclude_task_ids=ids), ids):
        assert len(hits) == 3 and all(h.entry.task_id != task_id for h in hits)
    # Allowed self-retrieval is the plain top-k: task 0's query then finds its own entries.
    (hits,) = bank.search([entries[0].task], n_ret=len(bank), exclude_task_ids=[own],
                          allow_self_retrieval=True)
    assert sum(h.entry.task_id == own for h in hits) == 4
    reference = embedder.embed_queries([entries[0].task]) @ bank.embeddings().T
    np.testing.assert_allclose([h.score for h in hits], np.sort(reference[0])[::-1], atol=1e-5)


def test_an_eval_split_entry_is_refused_and_nothing_is_written(bank, env, tiny_tokenizer):
    task = env.tasks("eval")[0]
    (rollout,) = agent.run_episodes(env, [task], policies.OraclePolicy(), tiny_tokenizer,
                                    max_turns=8, max_new_tokens=96, batch_size=1)
    eval_entry = Experience.from_rollout(rollout, task)
    train_entry = replace(bank.entries[0], trace=bank.entries[0].trace + "\n(new)",
                          entry_id=None)
    before = len(bank)
    with pytest.raises(BankError, match=rf"task {task.task_id} is from the 'eval' split"):
        bank.add([train_entry, eval_entry])
    assert len(bank) == before
    with pytest.raises(BankError, match="'eval' split"):
        bank.add_rollouts([rollout], {task.task_id: task})
    with pytest.raises(BankError, match="not a 'train'-split task"):
        bank.add_rollouts([rollout], {})


def test_reopening_gives_identical_search_results(bank, embedder, entries):
    queries = [e.task for e in entries[:10]] + ["Refund order O9."]
    ids = [e.task_id for e in entries[:10]] + [None]
    before = _as_lists(bank.search(queries, n_ret=4, exclude_task_ids=ids))
    matrix = bank.embeddings()
    bank.close()
    with ExperienceBank.open(bank.folder, embedder=embedder) as reopened:
        assert reopened.entries == bank.entries
        assert np.array_equal(reopened.embeddings(), matrix)
        assert _as_lists(reopened.search(queries, n_ret=4, exclude_task_ids=ids)) == before
    other = TransformersEmbedder(replace(SPEC, query_instruction="Query: "), embedder.backbone,
                                 embedder.tokenizer)
    with pytest.raises(BankError, match="was built with embedder"):
        ExperienceBank.open(bank.folder, embedder=other)


def test_a_crash_in_the_middle_of_add_leaves_the_bank_unchanged(bank, embedder, entries,
                                                                 monkeypatch):
    queries = [e.task for e in entries[:8]]
    before = _as_lists(bank.search(queries, n_ret=3))
    count = len(bank)
    new = [replace(e, trace=e.trace + "\n(second try)") for e in entries[:5]]
    real_row = experience._row
    calls = []

    def row_then_crash(*args):
        calls.append(1)
        if len(calls) == 3:    # two rows are already written in this transaction
            raise RuntimeError("simulated crash")
        return real_row(*args)

    monkeypatch.setattr(experience, "_row", row_then_crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        bank.add(new)
    assert len(calls) == 3
    monkeypatch.setattr(experience, "_row", real_row)
    assert len(bank) == count
    assert _as_lists(bank.search(queries, n_ret=3)) == before
    with ExperienceBank.open(bank.folder, embedder=embedder) as reopened:
        assert len(reopened) == count
        assert _as_lists(reopened.search(queries, n_ret=3)) == before
    # Nothing was left open or locked: the same add now succeeds in full, and persists.
    assert len(bank.add(new).added) == 5
    bank.close()
    with ExperienceBank.open(bank.folder, embedder=embedder) as reopened:
        assert len(reopened) == count + 5


def test_duplicates_are_stored_once(bank, entries):
    count = len(bank)
    again = bank.add(entries[:5])
    assert again.counts() == {"added": 0, "duplicates": 5, "below_threshold": 0}
    fresh = replace(entries[0], trace=entries[0].trace + "\n(other)")
    result = bank.add([fresh, fresh, replace(fresh, source="elsewhere")])
    assert result.counts() == {"added": 1, "duplicates": 2, "below_threshold": 0}
    assert len(bank) == count + 1


def test_reward_threshold(tmp_path, embedder, entries):
    half = [replace(e, reward=0.5) for e in entries[:4]]
    with ExperienceBank.create(tmp_path / "strict", embedder) as strict:
        assert strict.reward_threshold == 1.0
        result = strict.add(half + entries[4:6])
        assert result.counts() == {"added": 2, "duplicates": 0, "below_threshold": 4}
        assert len(strict) == 2
    with ExperienceBank.create(tmp_path / "lenient", embedder, reward_threshold=0.5) as lenient:
        assert len(lenient.add(half).added) == 4
    with ExperienceBank.open(tmp_path / "lenient", embedder=embedder) as reopened:
        assert reopened.reward_threshold == 0.5 and len(reopened) == 4


def test_embedder_batches_and_query_instruction(embedder):
    texts = ["Cancel order O1.", "Move policy P162 of holder H778 to the premium plan now.", "x"]
    together = embedder.encode(texts)
    alone = np.concatenate([embedder.encode([t]) for t in texts])
    np.testing.assert_allclose(together, alone, atol=1e-5)   # padding does not leak in
    asymmetric = TransformersEmbedder(replace(SPEC, query_instruction="Query: "),
                                      embedder.backbone, embedder.tokenizer)
    np.testing.assert_allclose(asymmetric.embed_queries(["abc"]), embedder.encode(["Query: abc"]),
                               atol=1e-6)
    np.testing.assert_allclose(asymmetric.embed_documents(["abc"]), embedder.encode(["abc"]),
                               atol=1e-6)


def test_minilm_default_embedder_loads_offline_and_ranks_by_meaning():
    minilm = load_embedder(EmbedderSpec())
    assert minilm.dim == 384
    query, same, other = minilm.encode(["Cancel order O482 of customer C120.",
                                        "Cancel order O911 of customer C305.",
                                        "Book patient N218 with doctor D724 on wed."])
    assert query @ same > query @ other + 0.1


def test_opening_a_missing_or_corrupt_bank_is_a_clear_error(tmp_path, embedder):
    with pytest.raises(BankError, match="no experience bank"):
        ExperienceBank.open(tmp_path / "nowhere", embedder=embedder)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / experience.DB_NAME).write_bytes(b"not a database" * 100)
    with pytest.raises(BankError, match="not a readable experience bank"):
        ExperienceBank.open(tmp_path / "junk", embedder=embedder)
    ExperienceBank.create(tmp_path / "made", embedder).close()
    with pytest.raises(BankError, match="already holds an experience bank"):
        ExperienceBank.create(tmp_path / "made", embedder)


def test_retrieval_quality_counts_template_matches(bank, env):
    queries = env.tasks("eval")
    quality = retrieval_quality(bank, queries, k=3)
    hits = bank.search([t.instruction for t in queries], 3)
    top1 = [h[0].entry.meta["template"] == t.meta["template"] and h[0].entry.domain == t.domain
            for t, h in zip(queries, hits)]
    assert quality["queries"] == len(queries)
    assert quality["top1_template"] == pytest.approx(sum(top1) / len(queries))
    assert quality["top1_template"] <= quality["top3_any_template"] <= 1.0
    assert 0 < quality["chance_top1_template"] < 1
    assert sum(d["queries"] for d in quality["per_domain"].values()) == len(queries)


# ----------------------------------------------------------------------------------------------
# lopd bank

SMALL = ["--set", "bank.embedder=policy", "--set", "env.train_size=40", "--set",
         "env.eval_size=12", "--set", "env.pretrain_size=0"]


def test_cli_build_stats_query_add_eval(tmp_path, capsys):
    out, episodes = tmp_path / "bank", tmp_path / "episodes.jsonl"
    assert main(["bank", "build", "--agent", "oracle", "--limit", "12", "--out", str(out),
                 "--episodes", str(episodes), "--json", str(tmp_path / "build.json"), *SMALL]) == 0
    built = json.loads((tmp_path / "build.json").read_text())
    assert built["rollouts"] == built["successes"] == built["added"] == built["entries"] == 12
    assert sum(d["added"] for d in built["per_domain"].values()) == 12

    assert main(["bank", "stats", str(out), "--json", str(tmp_path / "stats.json")]) == 0
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats["entries"] == 12 and stats["per_domain"] == {
        d: v["added"] for d, v in sorted(built["per_domain"].items())}
    assert stats["reward_threshold"] == 1.0 and stats["embedder"].startswith("policy (toolworld-1m")

    assert main(["bank", "query", str(out), "Cancel order O1 of customer C2.", "-k", "2",
                 "--json", str(tmp_path / "query.json")]) == 0
    hits = json.loads((tmp_path / "query.json").read_text())["hits"]
    assert [h["rank"] for h in hits] == [1, 2] and hits[0]["score"] >= hits[1]["score"]
    assert "score" in capsys.readouterr().out

    # Adding the same rollouts again stores nothing new.
    assert main(["bank", "add", str(out), "--rollouts", str(episodes), *SMALL,
                 "--json", str(tmp_path / "add.json")]) == 0
    added = json.loads((tmp_path / "add.json").read_text())
    assert added["added"] == 0 and added["duplicates"] == 12 and added["entries"] == 12

    assert main(["bank", "eval", str(out), *SMALL, "--json", str(tmp_path / "eval.json")]) == 0
    quality = json.loads((tmp_path / "eval.json").read_text())
    assert quality["queries"] == 12 and quality["k"] == 3


def test_cli_bad_input_is_a_clear_error_and_keeps_the_bank(tmp_path, capsys):
    out = tmp_path / "bank"
    assert main(["bank", "stats", str(tmp_path / "missing")]) == 2
    assert "no experience bank" in capsys.readouterr().err
    assert main(["bank", "build", "--split", "eval", "--out", str(out), *SMALL]) == 2
    assert "only training-split tasks" in capsys.readouterr().err
    assert not out.exists()

    assert main(["bank", "build", "--agent", "oracle", "--limit", "4", "--out", str(out),
                 *SMALL]) == 0
    corrupt = tmp_path / "corrupt.jsonl"
    corrupt.write_text('{"task_id": "x"}\nnot json\n')
    assert main(["bank", "add", str(out), "--rollouts", str(corrupt), *SMALL]) == 2
    assert f"{corrupt}:1: not a rollout record" in capsys.readouterr().err

    evals = tmp_path / "eval.jsonl"
    assert main(["eval", "--agent", "oracle", "--split", "eval", "--limit", "2", "--episodes",
                 str(evals), *SMALL]) == 0
    capsys.readouterr()
    assert main(["bank", "add", str(out), "--rollouts", str(evals), *SMALL]) == 2
    assert "from the 'eval' split" in capsys.readouterr().err
    assert main(["bank", "stats", str(out), "--json", str(tmp_path / "s.json")]) == 0
    assert json.loads((tmp_path / "s.json").read_text())["entries"] == 4


def test_refresh_picks_up_entries_another_writer_added(bank, embedder, entries):
    with ExperienceBank.open(bank.folder, embedder=embedder) as reader:
        count = len(reader)
        bank.add([replace(entries[1], trace=entries[1].trace + "\n(elsewhere)")])
        assert len(reader) == count
        reader.refresh()
        assert len(reader) == count + 1
        assert np.array_equal(reader.embeddings(), bank.embeddings())


def test_the_papers_embedder_setting_is_expressible_in_config(tmp_path, embedder):
    from lopd.config import load_config
    from lopd.embedding import spec_from_config

    path = tmp_path / "paper.yaml"
    path.write_text('bank:\n  embedder: hf\n  embedder_path: /models/Qwen3-Embedding-8B\n'
                    '  pooling: last\n  query_instruction: "Instruct: Find solved tasks\\nQuery: "\n')
    spec = spec_from_config(load_config(path).bank, model_path="toolworld-1m")
    assert spec == EmbedderSpec(kind="hf", path="/models/Qwen3-Embedding-8B", pooling="last",
                                query_instruction="Instruct: Find solved tasks\nQuery: ")
    policy = spec_from_config(load_config(None, ["bank.embedder=policy"]).bank, "some/model")
    assert policy.kind == "policy" and policy.path == "some/model"
    with pytest.raises(BankError, match="not a local model folder"):
        load_embedder(spec)

    # Last-token pooling is the final real token's state, however the batch is padded.
    last = TransformersEmbedder(replace(SPEC, pooling="last"), embedder.backbone,
                                embedder.tokenizer)
    texts = ["Refund order O1 of customer C2 now.", "x y"]
    ids = embedder.tokenizer(texts[0], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        state = embedder.backbone(input_ids=ids).last_hidden_state[0, -1]
    np.testing.assert_allclose(last.encode(texts)[0], (state / state.norm()).numpy(), atol=1e-5)


def test_added_rollouts_are_kept_for_the_cold_start(tmp_path):
    from lopd import agent, models
    from lopd.envs import get_env

    _, tokenizer = models.load_model("toolworld-1m")
    env = get_env("toolworld", seed=0, sizes={"eval": 2, "train": 6, "pretrain": 0})
    tasks = env.tasks("train")
    rollouts = agent.run_episodes(env, tasks, policies.OraclePolicy(), tokenizer, max_turns=8,
                                  max_new_tokens=96, batch_size=6)
    bank = ExperienceBank.create(tmp_path, load_embedder(EmbedderSpec(kind="policy", path="toolworld-1m")))
    by_id = {t.task_id: t for t in tasks}
    bank.add_rollouts(rollouts[:4], by_id)
    bank.add_rollouts(rollouts, by_id)          # 4 duplicates, 2 new
    stored = bank.stored_rollouts()
    assert [r.task_id for r in stored] == [r.task_id for r in rollouts]
    assert stored[0].input_ids == rollouts[0].input_ids
    assert stored[0].action_mask == rollouts[0].action_mask
