"""Speculative flags resolve to a chain length per algorithm, and contradictions are refused."""
import pytest

from engine.args import DEFAULT_NUM_STEPS, parse_args


@pytest.mark.parametrize("algo", ["eagle", "eagle3", "ngram"])
def test_chain_length_defaults_per_algorithm(algo):
    assert parse_args(["--speculative-algorithm", algo]).num_steps == DEFAULT_NUM_STEPS[algo]


def test_chain_length_from_flags():
    assert parse_args(["--speculative-algorithm", "ngram", "--speculative-num-steps", "2"]).num_steps == 2
    assert parse_args(["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "5"]).num_steps == 4
    assert parse_args(["--speculative-algorithm", "none"]).num_steps == 0
    assert parse_args([]).num_steps == DEFAULT_NUM_STEPS["eagle"]          # the embedded default serves EAGLE
    assert parse_args(["--num-scheduler-steps", "4"]).num_scheduler_steps == 4     # speculative rounds a launch


@pytest.mark.parametrize("flags, message", [
    (["--speculative-eagle-topk", "4"], "only chain drafts"),
    (["--speculative-num-steps", "3", "--speculative-num-draft-tokens", "6"], "must be --speculative-num-steps + 1"),
    (["--speculative-num-steps", "0"], "at least 1"),
    (["--speculative-algorithm", "eagle3", "--model-path", "/nonexistent"], "needs --speculative-draft-model-path"),
    (["--num-scheduler-steps", "0", "--speculative-algorithm", "none"], "--num-scheduler-steps must be at least 1"),
])
def test_contradictions_are_refused(flags, message, capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(flags)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_dp_attention_flags_are_checked():
    from pathlib import Path
    moe = str(Path(__file__).resolve().parent.parent / "models" / "tandem-moe")
    args = parse_args(["--model-path", moe, "--enable-dp-attention", "--dp-size", "2"])
    assert args.enable_dp_attention and args.nnodes == 1
    for bad in (["--enable-dp-attention", "--dp-size", "2"],                          # a dense model
                ["--model-path", moe, "--enable-dp-attention", "--dp-size", "1"],
                ["--model-path", moe, "--enable-dp-attention", "--dp-size", "3", "--nnodes", "2",
                 "--dist-init-addr", "127.0.0.1:5000"],
                ["--model-path", moe, "--dp-size", "2", "--nnodes", "2"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_ranks_across_hosts_need_a_rank_secret(capsys):
    """Node 0's rank port listens on the network: without a --rank-secret anyone could join as a rank."""
    from pathlib import Path
    moe = str(Path(__file__).resolve().parent.parent / "models" / "tandem-moe")
    multi = ["--model-path", moe, "--enable-dp-attention", "--dp-size", "2", "--nnodes", "2",
             "--dist-init-addr", "127.0.0.1:5000"]
    with pytest.raises(SystemExit):
        parse_args(multi)
    assert "--nnodes > 1 needs --rank-secret" in capsys.readouterr().err
    assert parse_args([*multi, "--rank-secret", "s"]).rank_secret == "s"


def test_experts_split_evenly_over_the_ranks():
    from engine.dp import expert_range
    assert [expert_range(8, r, 3) for r in range(3)] == [(0, 3), (3, 6), (6, 8)]
    assert [expert_range(8, r, 2) for r in range(2)] == [(0, 4), (4, 8)]
