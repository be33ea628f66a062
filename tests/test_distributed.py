"""torchrun on CPU (gloo): 2 processes equal 1 process on the same global batch (DDP and FSDP2, GRPO
and LOPD), a killed 2-process run resumes exactly, and two torchrun agents (two "nodes" on
localhost) train together."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from conftest import LOPD_SPEC as SPEC
from conftest import make_lopd_inputs
from lopd import distributed, trainer
from lopd.algorithms import get_algorithm
from lopd.config import load_config

TIMEOUT = 300
SKIP = ("time/", "memory/")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return make_lopd_inputs(tmp_path_factory.mktemp("dist-inputs"))


def config(inputs, algo, **sets):
    # run.seed 1: a GRPO group of the first step has rewards that differ (a gradient to compare).
    values = {"run.seed": 1, "env.train_size": 40, "env.eval_size": 4, "env.pretrain_size": 0,
              "train.algorithm": algo, "train.rollouts_per_step": 4, "train.eval_tasks": 3,
              "train.max_steps": 2, "train.eval_every": 2, "train.save_every": 1,
              "rollout.max_turns": 2, "rollout.max_completion_length": 48,
              "rollout.batch_size": 4, "grpo.num_generations": 2,
              "sdpo.num_generations": 2, "skill_sd.num_generations": 2,
              "composer.num_latents": SPEC.num_latents, "composer.depth": SPEC.depth,
              "composer.max_experience_tokens": SPEC.max_experience_tokens, "bank.n_ret": 2,
              "lopd.composer": str(inputs / "composer"), "lopd.bank": str(inputs / "bank"),
              # The paper's rate (as in test_algorithms): Adam turns fp32 noise on a gradient that
              # is zero analytically (the compressor's key bias) into a move of up to lr·1e-2;
              # at 1e-5 that stays below the 1e-6 checked, every other weight moves by ~lr.
              "train.learning_rate": 1e-5, "lopd.composer_learning_rate": 1e-5,
              **sets}
    return load_config("tiny", [f"{k}={v}" for k, v in values.items()])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(*args, nproc=2, extra=()):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            *extra, "-m", "lopd", "train", *args]


def standalone():
    return ("--nnodes", "1", "--master_addr", "127.0.0.1", "--master_port", str(free_port()))


ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def launch(cfg, run_dir: Path, tmp: Path):
    path = tmp / f"{run_dir.name}.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    done = subprocess.run(torchrun("--config", str(path), "--algo", cfg.train.algorithm, "--out",
                                   str(run_dir), extra=standalone()),
                          env=ENV, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def one_process_reference(cfg, run_dir: Path, shards: int = 2):
    """One process on the same global batch: its rollouts sampled in the same shards with the same
    seeds as the ranks' (sampling draws depend on the batch a row is generated in)."""
    t = trainer.Trainer(cfg, run_dir, get_algorithm(cfg.train.algorithm), progress=False)
    plain = t.rollouts

    def sharded(tasks, temperature, seed):
        size = len(tasks) // shards
        return [r for k in range(shards) for r in
                plain(tasks[k * size:(k + 1) * size], temperature, distributed.shard_seed(seed, k))]

    t.rollouts = sharded
    t.run()


def metrics(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in trainer.read_jsonl(run_dir / trainer.METRICS_FILE)}


def assert_metrics_equal(a: dict, b: dict, steps, tol=1e-5, skip=()):
    for step in steps:
        keys = {k for k, v in a[step].items() if isinstance(v, (int, float))
                and not k.startswith(SKIP) and k not in skip}
        assert keys <= set(b[step]), (step, keys - set(b[step]))
        for key in sorted(keys):
            assert b[step][key] == pytest.approx(a[step][key], rel=tol, abs=tol), (step, key)


def weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    folder = run_dir / trainer.CHECKPOINTS / f"step-{step:06d}"
    found = {f"student.{k}": v for f in sorted((folder / "student").glob("*.safetensors"))
             for k, v in load_file(f).items()}
    for f in sorted((folder / "composer").glob("*.safetensors")) if (folder / "composer").is_dir() \
            else []:
        found.update({f"composer.{f.stem}.{k}": v for k, v in load_file(f).items()})
    return found


def assert_weights_equal(a: dict, b: dict, tol=1e-6):
    assert sorted(a) == sorted(b)
    for key in a:
        assert torch.allclose(a[key].float(), b[key].float(), rtol=0, atol=tol), key


@pytest.fixture(scope="module")
def references(inputs, tmp_path_factory):
    """One-process runs, built once per method."""
    root = tmp_path_factory.mktemp("dist-ref")
    made = {}

    def get(algo):
        if algo not in made:
            one_process_reference(config(inputs, algo), root / algo)
            made[algo] = root / algo
        return made[algo]

    return get


@pytest.fixture(scope="module")
def two_process_runs(inputs, tmp_path_factory):
    root = tmp_path_factory.mktemp("dist-2p")
    made = {}

    def get(algo, parallel, micro=0):
        key = (algo, parallel, micro)
        if key not in made:
            run = root / f"{algo}-{parallel}-{micro}"
            launch(config(inputs, algo, **{"train.parallel": parallel,
                                           "train.per_device_train_batch_size": micro}), run, root)
            made[key] = run
        return made[key]

    return get


@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
@pytest.mark.parametrize("algo", ["grpo", "lopd"])
def test_two_processes_equal_one_process_on_the_same_global_batch(references, two_process_runs,
                                                                  algo, parallel):
    one, two = references(algo), two_process_runs(algo, parallel)
    a, b = metrics(one), metrics(two)
    assert sorted(a) == sorted(b) == [0, 1, 2]
    assert_metrics_equal(a, b, [0, 1, 2])
    assert b[2]["generations"] == 8 and b[1]["action_tokens"] > 0
    first, second = weights(one, 1), weights(one, 2)
    # Not a trivial equality: the second step has a gradient and moves the weights.
    assert a[2]["student/grad_norm"] > 0
    assert any(not torch.equal(first[k], second[k]) for k in first if k.startswith("student."))
    assert_weights_equal(first, weights(two, 1))
    assert_weights_equal(second, weights(two, 2))
    # Rank 0 alone writes the run's files: one record per step, one eval per evaluation.
    assert [r["step"] for r in trainer.read_jsonl(two / trainer.EVAL_FILE)] == [0, 2]
    assert (two / trainer.PLOT_FILE).exists() and any((two / "tensorboard").iterdir())
    state = torch.load(trainer.checkpoints(two)[-1] / "state.pt", weights_only=False)
    assert state["world_size"] == 2 and state["parallel"] == parallel
    if algo == "lopd":
        assert b[2]["bank/size"] == a[2]["bank/size"] and "delta" in b[2]


@pytest.mark.parametrize("algo", ["sdft", "opsd", "sdpo", "skill_sd"])
def test_the_baselines_in_two_ddp_processes_equal_one_process(references, two_process_runs, algo):
    """Each baseline keeps state beside the student (an EMA teacher, a frozen θ0, a skill
    library): two DDP ranks must take the one-process steps and write the same weights."""
    one, two = references(algo), two_process_runs(algo, "ddp")
    a, b = metrics(one), metrics(two)
    assert sorted(a) == sorted(b) == [0, 1, 2]
    assert_metrics_equal(a, b, [0, 1, 2])
    # 1e-5 (the step's move), as with micro-batches below: on an AMD EPYC CPU one OPSD o_proj
    # weight, a near-zero gradient's Adam step, lands 1.3e-6 off.
    assert_weights_equal(weights(one, 1), weights(two, 1), tol=1e-5)
    assert_weights_equal(weights(one, 2), weights(two, 2), tol=1e-5)
    if algo in ("sdft", "opsd"):  # every rollout has a teacher signal: the steps really move
        assert a[2]["student/grad_norm"] > 0


def test_micro_batches_under_ddp_equal_one_pass(references, two_process_runs):
    """Two micro-batches per rank: DDP skips the all-reduce of the first backward (no_sync)."""
    one, two = references("lopd"), two_process_runs("lopd", "ddp", micro=1)
    a, b = metrics(one), metrics(two)
    assert b[1]["micro_batches"] == 2
    assert_metrics_equal(a, b, [0, 1, 2], skip=("micro_batches",))
    # 1e-5 (the step's move): one q_proj weight, a near-zero gradient's Adam step, lands 1.1e-6 off.
    assert_weights_equal(weights(one, 2), weights(two, 2), tol=1e-5)


def test_a_killed_two_process_run_resumes_exactly(inputs, two_process_runs, tmp_path):
    whole = two_process_runs("lopd", "ddp")
    broken = tmp_path / "broken"
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(config(inputs, "lopd").to_dict()))
    proc = subprocess.Popen(torchrun("--config", str(path), "--algo", "lopd", "--out", str(broken),
                                     extra=standalone()),
                            env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + TIMEOUT
    while time.time() < deadline and not trainer.checkpoints(broken):
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the agent and both workers, as a lost node would
    proc.wait()
    assert [c.name for c in trainer.checkpoints(broken)] == ["step-000001"]
    done = subprocess.run(torchrun("--resume", str(broken), extra=standalone()), env=ENV,
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-4000:]
    a, b = metrics(whole), metrics(broken)
    assert sorted(b) == [0, 1, 2]
    assert_metrics_equal(a, b, [2], tol=1e-6)
    assert_weights_equal(weights(whole, 2), weights(broken, 2), tol=1e-6)


def test_two_torchrun_agents_on_localhost_train_a_step(inputs, tmp_path):
    cfg = config(inputs, "grpo", **{"train.max_steps": 1})
    path = tmp_path / "two-nodes.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    port = str(free_port())
    run = tmp_path / "two-nodes"
    agents = [subprocess.Popen(
        torchrun("--config", str(path), "--algo", "grpo", "--out", str(run), nproc=1,
                 extra=("--nnodes", "2", "--node_rank", str(node), "--master_addr", "127.0.0.1",
                        "--master_port", port)),
        env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for node in (0, 1)]
    outputs = [p.communicate(timeout=TIMEOUT) for p in agents]
    assert [p.returncode for p in agents] == [0, 0], [err[-3000:] for _, err in outputs]
    records = metrics(run)
    assert sorted(records) == [0, 1] and records[1]["generations"] == 4
    state = torch.load(trainer.checkpoints(run)[-1] / "state.pt", weights_only=False)
    assert state["world_size"] == 2


def test_a_two_process_checkpoint_resumes_in_one_process_and_says_what_changes(
        two_process_runs, tmp_path, capsys):
    import shutil

    run = tmp_path / "copy"
    shutil.copytree(two_process_runs("lopd", "ddp"), run)
    cfg = trainer.read_config(run, ["train.max_steps=3"])
    t = trainer.Trainer(cfg, run, get_algorithm("lopd"), resume=True, progress=False)
    note = capsys.readouterr().err
    assert "written by 2 process(es) and resumes on 1" in note and "differ" in note
    assert t.start_step == 2 and t.ctx.student_updater.optimizer.state  # DCP state loaded
    t.run()
    assert sorted(metrics(run)) == [0, 1, 2, 3]
