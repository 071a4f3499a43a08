import argparse
import json
import shutil

import pytest

from aisrl.cli import main


def test_bench_estimator_runs_end_to_end(tmp_path, capsys):
    out = tmp_path / "e.json"
    args = ["bench", "estimator", "vocab=3", "length=2", "batches=5", "instances=1", "strengths=[0.2]",
            "sharpness=[1.0]", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    data = json.loads(out.read_text())
    assert data["config"]["vocab"] == 3 and len(data["points"]) == 1 and "machine" in data
    assert "mean MSE / MSE(oracle alpha*)" in capsys.readouterr().out


def test_bad_override_is_one_clear_line(capsys):
    assert main(["bench", "estimator", "batchez=3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("aisrl: error: unknown config key 'batchez'") and "Traceback" not in err
    # a key with a dash first: an override refused by name (before: an unknown preset 'max-steps=3')
    assert main(["train", "max-steps=3"]) == 2
    assert "unknown config key 'max-steps' (did you mean 'max_steps'?)" in capsys.readouterr().err


def test_a_key_given_twice_is_refused_before_anything_runs(tmp_path, capsys):
    out = tmp_path / "r"
    for argv in (["train", "lab", "max_steps=2", f"output_dir={out}", "max_steps=3"],
                 ["train", "max_steps=2", f"output_dir={out}", " max_steps =3"],  # the first override, spaced
                 ["bench", "estimator", "batches=3", "batches=4"]):  # fmt: skip
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "'max_steps'" in err or "'batches'" in err
        assert "given more than once" in err and "Traceback" not in err
    assert not out.exists()  # refused before the run folder was made
    # the study merges `train=[...]` and bare training keys: one key in both is refused too, as in branch
    for command in ("compare", "branch"):
        assert main([command, "train=[lr=1e-3]", "lr=2e-3", f"out={tmp_path / command}"]) == 2
        err = capsys.readouterr().err
        assert "'lr' given more than once in the training keys" in err and "lr=1e-3 lr=2e-3" in err, err
    assert main(["compare", "train=[lr=1e-3]", "seed=2", "seeds=[0]"]) == 2  # distinct keys pass to later checks
    assert "given more than once" not in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_a_setting_given_as_an_argument_and_as_a_key_is_refused(tmp_path, capsys, monkeypatch):
    """Before, compare took the key, branch the argument and mismatch the key, each without a word (found by
    review)."""
    import aisrl.branch
    import aisrl.compare
    import aisrl.doctor

    def ran(*a, **k):
        raise AssertionError("the command ran")

    for module, name in ((aisrl.compare, "run_study"), (aisrl.branch, "run_branches"), (aisrl.doctor, "main")):
        monkeypatch.setattr(module, name, ran)
    for argv, message in (
            (["compare", "lab", "preset=lab_columns"], "the preset is given twice, 'lab' and preset=lab_columns"),
            (["branch", "lab", "run=x", "step=3", "preset=lab_columns"], "the preset is given twice, 'lab'"),
            (["mismatch", "--model", "tiny-llama", "model=smollm2"], "model is given twice, --model tiny-llama and "
                                                                     "model=smollm2"),
            (["mismatch", "--formats", "int4", "formats=[mxfp4]"], "formats is given twice"),
            (["mismatch", "--preset", "lab", "preset=lab_columns"], "preset is given twice"),
            (["mismatch", "--task", "countdown", "task=arithmetic"], "task is given twice")):  # fmt: skip
        assert main([*argv, f"out={tmp_path / 'o'}"] if argv[0] != "mismatch" else argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "give one" in err and "Traceback" not in err, err
    assert not any(tmp_path.iterdir())


def test_the_main_job_is_one_preset_everywhere():
    """`make run`, the README and `aisrl train` with no preset all mean DEFAULT_PRESET; a first argument that is
    an override is not taken for a preset."""
    import argparse
    from pathlib import Path

    from aisrl.cli import _train_config
    from aisrl.train_config import DEFAULT_PRESET, load_config

    root = Path(__file__).resolve().parents[1]
    assert f"aisrl train {DEFAULT_PRESET}\n" in (root / "Makefile").read_text()
    assert f"`make run` runs `aisrl train {DEFAULT_PRESET}`" in (root / "README.md").read_text()
    cfg = _train_config(argparse.Namespace(preset="max_steps=3", overrides=["lr=1e-3"]))
    assert cfg == load_config(DEFAULT_PRESET, ["max_steps=3", "lr=1e-3"]) and cfg.max_steps == 3
    assert cfg.lab.trace == "columns" and cfg.lab.target is None  # a fixed-length warm start (the same on any CPU)


def test_a_preset_path_holding_an_equals_sign_is_a_preset_and_options_may_follow_overrides(tmp_path, monkeypatch):
    # `aisrl branch` names its folders after the settings it changes (step80_rollout.quant=none): their config.json
    # must read as a preset, not as the override "…/step80_rollout.quant" = "none/config.json"
    import argparse
    import json

    from aisrl.cli import _is_override, _train_config
    from aisrl.train_config import load_config

    run = tmp_path / "step1_rollout.quant=none"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"max_steps": 7, "lr": 0.002}))
    cfg = _train_config(argparse.Namespace(preset=str(run / "config.json"), overrides=["eval_every=7"]))
    assert (cfg.max_steps, cfg.lr, cfg.eval_every) == (7, 0.002, 7)
    assert _is_override("correction.name=tis") and not _is_override("runs/x=1/c.yaml") and not _is_override("lab")
    assert _is_override("dataset=d.json") and _is_override("preset=my.yaml")  # before: taken for preset names
    assert load_config("lab", ["max_steps=3"]).max_steps == 3
    seen = {}
    monkeypatch.setattr("aisrl.cli._mismatch", lambda args: seen.update(vars(args)) or 0)
    assert main(["mismatch", "prompts=2", "--model", "tiny-llama", "max_new_tokens=4"]) == 0
    assert seen["model"] == "tiny-llama" and seen["overrides"] == ["prompts=2", "max_new_tokens=4"]
    with pytest.raises(SystemExit) as e:
        main(["train", "lab", "--nope"])
    assert e.value.code == 2  # argparse's usage error


def test_eval_scores_a_run_with_the_settings_it_recorded(tmp_path, capsys):
    """A run trained with seed=3 is scored on seed 3's held-out problems, whatever preset `aisrl eval` is given."""
    import argparse
    import dataclasses

    from aisrl.cli import _run_config, _train_config
    from aisrl.train_config import load_config

    run = tmp_path / "run"
    notes = []
    args = argparse.Namespace(preset="lab_columns", overrides=[f"output_dir={run}", "eval_problems=7"])
    assert _run_config(args, notes.append) == load_config("lab_columns", args.overrides)  # nothing recorded yet
    run.mkdir()
    trained = load_config("lab_columns", ["seed=3", "lr=1e-3", f"output_dir={run}"])
    (run / "config.json").write_text(json.dumps(dataclasses.asdict(trained)))
    cfg = _run_config(args, notes.append)
    assert (cfg.seed, cfg.lr, cfg.eval_problems) == (3, 1e-3, 7)  # the record, then the overrides typed
    assert len(notes) == 1 and "seed: 3 -> 0" in notes[0] and "lr: 0.001 -> " in notes[0]
    cfg = _run_config(argparse.Namespace(preset=f"output_dir={run}", overrides=[]), notes.append)
    assert cfg.seed == 3 and len(notes) == 1  # no preset named: nothing to note
    (run / "config.json").write_text(json.dumps({**dataclasses.asdict(trained), "gone": 1}))  # another version
    assert _run_config(args, notes.append).seed == 0 and "does not load" in notes[-1]
    # with no preset typed, a record that does not load is an error: the default preset (another task, another
    # model) scored the run before, and exited 0
    with pytest.raises(ValueError, match=r"does not load .* pass the one it was trained with: aisrl eval PRESET"):
        _run_config(argparse.Namespace(preset=f"output_dir={run}", overrides=[]), notes.append)
    # a run copied elsewhere is scored (and trained) in its new folder, not in the one its record names
    (run / "config.json").write_text(json.dumps(dataclasses.asdict(trained)))
    moved = tmp_path / "moved"
    shutil.copytree(run, moved)
    for given in (argparse.Namespace(preset=str(moved / "config.json"), overrides=[]),
                  argparse.Namespace(preset=f"output_dir={moved}", overrides=[])):  # fmt: skip
        cfg = _run_config(given, notes.append)
        assert cfg.output_dir == str(moved) and cfg.seed == 3
    assert "records output_dir=" in notes[-1] and str(moved) in notes[-1]  # the file's folder, said once
    assert _train_config(argparse.Namespace(preset=str(moved / "config.json"), overrides=[])).output_dir == str(moved)
    typed = argparse.Namespace(preset=str(moved / "config.json"), overrides=[f"output_dir={tmp_path / 'new'}"])
    assert _train_config(typed).output_dir == str(tmp_path / "new")  # a template for a new run: output_dir typed
    # a bad override is named as in training, before anything is built (before: eval_problems=0 ran into "the task
    # gives 64 training and 0 held-out problems", and seed=-1 was taken)
    (run / "config.json").write_text(json.dumps(dataclasses.asdict(trained)))
    for bad, message in (("eval_problems=0", "config key 'eval_problems' must be >= 1"),
                         ("seed=-1", "seed must be in [0, 1000000000), got -1")):  # fmt: skip
        assert main(["eval", f"output_dir={run}", bad]) == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(("command", "shown"), [
    ("train", ["rollout.quant='fp8_e4m3_w8a8'", "correction.name='ais'", "Mismatch correction: any name in"]),
    ("compare", ["reference_format='auto'", "seeds=[0, 1, 2]", "any other key=value is a training key"]),
    ("branch", ["salts=[1, 2, 3]", "The checkpoint every branch starts from"]),
])  # fmt: skip
def test_help_lists_every_key_with_its_default_and_documentation(command, shown, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and all(s in out for s in shown), out[-2000:]


def test_study_arguments_that_went_wrong_say_how(capsys):
    assert main(["compare", "method=[tis]"]) == 2  # a misspelt study key, not only "not a training key"
    assert "unknown key 'method': neither a key of the study nor a training key; did you mean 'methods'?" in (
        capsys.readouterr().err)  # fmt: skip
    assert main(["branch", "run=r", "step=1", "salt=[1]"]) == 2
    assert "did you mean 'salts'?" in capsys.readouterr().err
    assert main(["branch", "run=r", "step=1", "max_step=3"]) == 2  # a training key, misspelt (before: 'step')
    assert "did you mean 'max_steps'?" in capsys.readouterr().err
    assert main(["compare", "methods=[none,", "tis]"]) == 2  # the shell split an unquoted list at its space
    assert 'a space split it from the rest: quote the whole argument, "methods=[a, b]"' in capsys.readouterr().err
    long = "x" * 400
    assert main(["train", long]) == 2 and f"unknown preset '{long[:80]}'" in capsys.readouterr().err  # was OSError
    assert main(["compare", f"out={long}"]) == 2  # an override too long to be a file name is still an override
    assert "a name in it is past the 255 bytes a file system takes" in capsys.readouterr().err  # was OSError


def test_train_prints_a_summary_with_nothing_measured(monkeypatch, capsys, tmp_path):
    from aisrl.report import summarize

    # a finished run whose metrics.jsonl was removed trains nothing: an empty summary (before: TypeError on None)
    monkeypatch.setattr("aisrl.trainer.train", lambda cfg: {**summarize([]), "report": "r.png"})
    assert main(["train", "lab", f"output_dir={tmp_path}"]) == 0
    assert "reward: first fifth - -> last fifth -; held-out greedy accuracy not measured" in capsys.readouterr().out


def test_branch_adds_bare_training_keys_to_a_train_list(monkeypatch):
    seen = {}
    monkeypatch.setattr("aisrl.branch.run_branches", lambda cfg: seen.setdefault("cfg", cfg) and {})
    monkeypatch.setattr("aisrl.branch.table", lambda result: "")
    assert main(["branch", "run=r", "step=1", "max_steps=3", "train=[lr=1e-3]"]) == 0
    assert seen["cfg"].train == ["lr=1e-3", "max_steps=3"]
    # a spaced study key is the study's, as apply_overrides reads it (before: the raw text went to the training keys)
    seen.clear()
    assert main(["branch", " run =r", "step= 1", " salts =[4]", " max_steps = 3"]) == 0
    assert (seen["cfg"].run, seen["cfg"].step, seen["cfg"].salts) == ("r", 1, [4])
    assert seen["cfg"].train == [" max_steps = 3"]


def test_mismatch_refuses_a_model_given_with_start_even_the_default(capsys):
    assert main(["mismatch", "--model", "smollm2", "start=nowhere:3"]) == 2
    assert "['model'] come from the preset or run (preset=, start=)" in capsys.readouterr().err


def test_train_summary_puts_the_starting_accuracy_first(monkeypatch, capsys, tmp_path):
    s = {"eval_accuracy": [(10, 0.5)], "eval_accuracy_start": 0.25, "reward_first_fifth": 0.1,
         "reward_last_fifth": 0.2, "report": "r.png"}
    monkeypatch.setattr("aisrl.trainer.train", lambda cfg: s)
    assert main(["train", "lab", f"output_dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "reward: first fifth 0.100 -> last fifth 0.200; held-out greedy accuracy 25.0% at the start, " \
           "50.0% at step 10" in out


def test_a_permission_error_is_one_line_and_exit_2(monkeypatch, capsys):
    def denied(cfg, out):
        raise PermissionError("denied here")

    monkeypatch.setattr("aisrl.doctor.main", denied)
    assert main(["mismatch", "--model", "tiny-llama"]) == 2
    assert capsys.readouterr().err == "aisrl: error: denied here\n"


def test_eval_without_a_checkpoint_is_one_line(tmp_path, capsys):  # not a TypeError on None
    assert main(["eval", f"output_dir={tmp_path}"]) == 2
    assert f"no checkpoint in {str(tmp_path)!r}; train first" in capsys.readouterr().err
    for seed in (1, 0):  # a study's folder: its runs are named (before: "pass output_dir=...", which was passed)
        (tmp_path / "fp8" / "ais" / f"seed{seed}" / "checkpoints").mkdir(parents=True)
        (tmp_path / "fp8" / "ais" / f"seed{seed}" / "checkpoints" / "latest").write_text("step_000002")
    assert main(["eval", f"output_dir={tmp_path}"]) == 2
    first = tmp_path / "fp8" / "ais" / "seed0"
    assert f"it holds runs (a study's folder?), each scored on its own: output_dir={first}" in capsys.readouterr().err


def test_eval_checks_typed_keys_against_the_run_it_scores(tmp_path, capsys):
    """The keys typed after `aisrl eval output_dir=RUN` were checked against the default preset (a causal lab), so
    a diffusion run's `diffusion.steps=40` was refused as unread (found by review); the run's record decides."""
    from dataclasses import asdict

    from aisrl.train_config import load_config

    for name, preset, verdict in (("d", "diffusion_lab", "no checkpoint in"), ("c", "lab", "would change nothing")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(asdict(load_config(preset))))
        assert main(["eval", f"output_dir={tmp_path / name}", "diffusion.steps=40"]) == 2
        assert verdict in capsys.readouterr().err, name


def test_bench_estimator_default_output_path(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # without --out: runs/estimator/estimator.json under the working directory
    assert main(["bench", "estimator", "vocab=3", "length=2", "batches=5", "instances=1", "strengths=[0.2]",
                 "sharpness=[1.0]"]) == 0
    assert (tmp_path / "runs" / "estimator" / "estimator.json").is_file()
    assert "results: runs/estimator/estimator.json" in capsys.readouterr().out


def test_an_unknown_option_among_overrides_is_argparse_usage_error(monkeypatch):
    # leftover arguments are overrides only when every one is key=value: '--nope' among them is refused
    seen = {}
    monkeypatch.setattr("aisrl.cli._mismatch", lambda args: seen.update(vars(args)) or 0)
    with pytest.raises(SystemExit) as e:
        main(["mismatch", "prompts=2", "--nope", "--model", "tiny-llama", "max_new_tokens=4"])
    assert e.value.code == 2 and not seen


def test_study_args_pass_dotted_training_keys_through():
    # rollout.quant and correction.name are training keys (their first part is), not misspelt study keys
    from aisrl.cli import _study_args
    from aisrl.compare import CompareConfig

    items = ["rollout.quant=none", "correction.name=tis", "seeds=[0]"]
    assert _study_args(argparse.Namespace(preset=None, overrides=items), CompareConfig) == (
        ["seeds=[0]"], ["rollout.quant=none", "correction.name=tis"])
