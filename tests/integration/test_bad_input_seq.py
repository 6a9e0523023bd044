"""A ``--seq`` longer than a zoo model's position embeddings: capture runs on the meta
device, which does not check the indices, so `plan` made a plan (and `ir` and `profile`
went on) that `hetplan run` refuses. Each command now refuses it by its flag, before the
model is built, with the model's limit and the fix."""

from __future__ import annotations

import pytest

from test_bad_input_round7 import refused, run  # the rounds share helpers


@pytest.fixture
def no_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    """The refusal comes first: capturing or measuring the model fails the test."""
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("the command went on to capture or measure the model")

    monkeypatch.setattr("hetplan.cli.load_model_ir", forbidden)
    monkeypatch.setattr("hetplan.profiling.run_profile", forbidden)
    monkeypatch.setattr("hetplan.ir.capture.capture", forbidden)


@pytest.mark.parametrize("argv", [
    ("plan", "tiny-gpt2", "--seq", "200", "-c", "local-cpu", "-b", "8", "--no-progress"),
    ("ir", "tiny-gpt2", "--seq", "200"),
    ("profile", "tiny-gpt2", "--seq", "200", "--what", "layers"),
])
def test_a_seq_past_the_positions_is_refused_by_its_flag(
        argv: tuple[str, ...], no_capture: None) -> None:
    flat = refused(run(*argv), "--seq 200: tiny-gpt2 has 128 positions",
                   "at most 128 tokens; give --seq 128 or less")
    assert flat.count("error:") == 1


def test_the_longest_sequence_is_accepted() -> None:
    result = run("ir", "gpt-test", "--seq", "32", "--batch", "1")
    assert result.exit_code == 0, result.output
    refused(run("ir", "gpt-test", "--seq", "33"), "--seq 33: gpt-test has 32 positions",
            "give --seq 32 or less")


@pytest.mark.parametrize("argv", [
    ("plan", "tiny-resnet", "--seq", "64", "-c", "local-cpu", "-b", "8", "--no-progress"),
    ("ir", "mlp", "--seq", "64"),
    ("profile", "tiny-vit", "--seq", "64", "--what", "layers"),
])
def test_a_seq_for_a_model_without_a_sequence_is_refused_by_its_flag(
        argv: tuple[str, ...], no_capture: None) -> None:
    """Was: ignored (an image or feature model's inputs have no sequence axis): the plan,
    workload or profile was the one made without --seq."""
    refused(run(*argv), f"--seq 64: {argv[1]} takes", "inputs without a sequence axis",
            "drop --seq")
