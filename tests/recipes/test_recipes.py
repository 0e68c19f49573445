"""Every recipe composes; every CPU variant runs a few steps; Hydra habits; your own recipe from a folder
outside the package; weights from a local save_pretrained folder; the installed package finds its configs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile

import pytest
import yaml

from tests.conftest import REPO, compose_job, run_torchrun
from trainer.compose import recipe_dirs

RECIPES = sorted(p.stem for d in recipe_dirs() for p in d.glob("*.yaml"))
# Keep CPU runs tiny: few records, two steps (the summary keeps the second), a fixed peak (measuring this
# CPU matmul rate takes a moment per process; the own-recipe run below still measures it).
QUICK = [
    "max_steps=2",
    "summary_skip_steps=1",
    "data.limit=200",
    "data.num_records=200",
    "optim.warmup_steps=1",
    "logger.peak_tflops=1",
]


def python_train(args: list[str], cwd, timeout: float = 240) -> subprocess.CompletedProcess:
    """``python -m trainer.train ARGS`` from ``cwd`` (outside the repository) with the repo importable."""
    env = os.environ | {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "trainer.train", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_recipes_are_shipped():
    assert {"cpu_dailydialog", "gpt2_dailydialog", "cpu_chat_sft", "qwen_chat_sft"} <= set(RECIPES)


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("packing", ["bfd", "none"])  # every recipe's own packing (bfd) and its padded baseline
def test_recipe_composes_and_names_its_command(name, packing):
    job = compose_job([f"recipe={name}", f"packing={packing}"])
    assert job.name == name and job.packing.strategy == packing
    assert job.model.trust_remote_code is False  # off unless the user turns it on
    path = next(p for d in recipe_dirs() for p in [d / f"{name}.yaml"] if p.is_file())
    first = path.read_text().splitlines()[0]
    assert first.startswith("# torchrun ") and "-m trainer.train" in first and f"recipe={name}" in first


def test_embedded_default_composes():
    job = compose_job([])
    assert job.data.source == "dailydialog_synthetic" and job.model.name_or_path is None


def test_chat_recipes_train_on_responses_only():
    jobs = {name: compose_job([f"recipe={name}"]) for name in ("cpu_chat_sft", "qwen_chat_sft")}
    for job in jobs.values():
        assert job.data.loss_on in ("auto", "responses")
        assert job.model.family in ("qwen2", "llama")
    assert jobs["qwen_chat_sft"].model.name_or_path == "Qwen/Qwen2.5-0.5B-Instruct"


def test_long_cot_gpu_recipe_packs_32k_rows_over_a_cp_group():
    """The GPU context-parallel recipe (composed, nothing downloaded): Qwen2.5-0.5B on a public long-CoT set,
    rows of 32k tokens (the model's context) over cp 2-8, FLOPs-balanced; its comment's variants keep the row."""
    job = compose_job(["recipe=qwen_long_cot"])
    assert job.model.name_or_path == "Qwen/Qwen2.5-0.5B-Instruct" and job.data.source == "hf" and job.data.path
    assert job.row_budget == job.data.max_length == 32768 and job.parallel.cp == 4 and job.packing.balance == "flops"
    job.validate_world(8)  # 2 data-parallel groups of 4
    for cp, budget in ((2, 16384), (8, 4096)):
        variant = compose_job(["recipe=qwen_long_cot", f"parallel.cp={cp}", f"packing.token_budget={budget}"])
        assert variant.row_budget == 32768
        variant.validate_world(8)


@pytest.mark.slow
def test_cfg_job_prints_the_resolved_config(tmp_path):
    proc = python_train(["recipe=cpu_chat_sft", "--cfg", "job", "--resolve"], cwd=tmp_path, timeout=120)
    assert_ok(proc)
    printed = yaml.safe_load(proc.stdout)
    assert printed["name"] == "cpu_chat_sft" and printed["model"]["family"] == "qwen2"
    assert "${" not in proc.stdout
    assert list(tmp_path.iterdir()) == []  # printing the config writes nothing


@pytest.mark.slow
def test_cpu_recipes_run_in_a_two_rank_multirun_sweep(tmp_path):
    """Every CPU recipe, packed and padded, as one Hydra sweep on 2 ranks: each job runs a few steps in its
    own run directory, and the process group carries over from job to job."""
    cpu_recipes = [
        n
        for n in RECIPES
        if compose_job([f"recipe={n}"]).parallel.device != "cuda"
        and compose_job([f"recipe={n}"]).parallel.cp == 1  # cp>1 has no padded run: the test below
        and compose_job([f"recipe={n}"]).objective != "distill"
    ]  # its teacher first: test_distill_recipes.py
    sweep = ["-m", "trainer.train", "-m", f"recipe={','.join(cpu_recipes)}", "packing=none,bfd", *QUICK]
    proc = run_torchrun(sweep, cwd=tmp_path, env={"PYTHONPATH": str(REPO)}, timeout=400)
    assert_ok(proc)
    assert "RESULT packed (bfd)" in proc.stdout and "RESULT padded (none)" in proc.stdout  # rank 0's last line
    assert [p.name for p in tmp_path.iterdir()] == ["outputs"]  # nothing else in the working directory
    # Hydra's multirun.yaml: one per sweep, under the name of the sweep's base config (`run` here).
    assert [p.parent.name for p in (tmp_path / "outputs").glob("*/multirun.yaml")] == ["run"]
    for name in cpu_recipes:
        runs = sorted(p for p in (tmp_path / "outputs" / name).iterdir() if p.is_dir())
        assert len(runs) == 2, runs
        summaries = [json.loads((r / "summary.json").read_text()) for r in runs]
        assert {s["strategy"] for s in summaries} == {"none", "bfd"}
        for run, summary in zip(runs, summaries, strict=True):
            assert summary["steps"] == 2 and summary["world_size"] == 2 and summary["useful_tokens_per_s"] > 0
            saved = yaml.safe_load((run / "config.yaml").read_text())  # the resolved config of the run
            assert saved["name"] == name and "${" not in json.dumps(saved)
            assert f"packing={saved['packing']['strategy']}" in run.name
            if name == "cpu_chat_sft":  # response-only loss: prompts are in the tokens but carry no label
                assert summary["dataset"]["label_tokens"] < 0.6 * summary["dataset"]["tokens"]


@pytest.mark.slow
def test_context_parallel_recipe_trains_the_losses_of_one_rank_with_the_row_budget(tmp_path):
    """The CPU context-parallel recipe: 2 ranks sharding each row (cp=2), preempted after step 2 (SIGUSR1 on
    one rank) and resumed, train the same per-step losses as 1 rank packing rows of twice the per-rank budget
    (cp=1), within 1e-4 (fp32), and the same end-of-run eval (sharded rows under cp=2)."""
    from trainer.stop_signals import PREEMPTED_EXIT_CODE

    quick = [
        "recipe=cpu_long_context",
        "max_steps=3",
        "data.num_records=120",
        "optim.warmup_steps=1",
        "logger.peak_tflops=1",
        "checkpoint.every_steps=0",
        "parallel=fsdp_fp32",
        "eval.holdout_fraction=0.1",
    ]
    env = {"PYTHONPATH": str(REPO)}
    sharded, single = tmp_path / "cp2", tmp_path / "cp1"
    stopped = run_torchrun(
        ["-m", "tests.faults.signal_entry", *quick, "parallel.cp=2", f"run_dir={sharded}"],
        cwd=tmp_path,
        env=env | {"PFTEST_SIGNAL": "SIGUSR1:self:1:2"},
        timeout=300,
    )
    assert f"exitcode  : {PREEMPTED_EXIT_CODE}" in stopped.stderr, stopped.stderr[-3000:]
    assert "(through the context-parallel route: cp=2" in stopped.stderr + stopped.stdout
    resumed = run_torchrun(
        ["-m", "trainer.train", *quick, "parallel.cp=2", f"run_dir={sharded}", "resume=auto"],
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert_ok(resumed)
    assert_ok(
        run_torchrun(
            ["-m", "trainer.train", *quick, "parallel.cp=1", "packing.token_budget=1024", f"run_dir={single}"],
            nproc=1,
            cwd=tmp_path,
            env=env,
            timeout=300,
        )
    )
    runs = {}
    for name, run in (("cp2", sharded), ("cp1", single)):
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        runs[name] = [r["loss"] for r in records]
        runs[name, "steps"] = [r["step"] for r in records]
        runs[name, "eval"] = [json.loads(line)["eval_loss"] for line in (run / "eval.jsonl").read_text().splitlines()]
    # the step records carry the group's skew under cp=2 only
    assert all(
        r.get("cp_skew") is not None for r in map(json.loads, (sharded / "metrics.jsonl").read_text().splitlines())
    )
    assert runs["cp2", "steps"] == runs["cp1", "steps"] == [1, 2, 3]  # nothing lost, nothing repeated
    assert runs["cp2"] == pytest.approx(runs["cp1"], abs=1e-4)
    assert runs["cp2", "eval"][-1:] == pytest.approx(runs["cp1", "eval"], abs=1e-5)


OWN_RECIPE = """\
# @package _global_
# python -m trainer.train hydra.searchpath=[file://myconf] recipe=faq_sft data.plugins=[my_sources.py]
defaults:
  - override /model: qwen2_tiny
  - override /packing: bfd
  - _self_

name: faq_sft
max_steps: 2
data:
  source: faq_lines
  path: faq.tsv
parallel:
  device: cpu
optim:
  warmup_steps: 1
"""

OWN_SOURCE = '''\
from trainer.data import register_source


@register_source("faq_lines")
def faq_lines(cfg):
    """One question<TAB>answer per line -> a two-message chat."""
    records = []
    with open(cfg.path, encoding="utf-8") as f:
        for line in f:
            question, _, answer = line.rstrip("\\n").partition("\\t")
            records.append({"messages": [{"role": "user", "content": question},
                                         {"role": "assistant", "content": answer}]})
    return records
'''


@pytest.mark.slow
def test_own_recipe_and_source_from_a_folder_outside_the_package(tmp_path):
    (tmp_path / "myconf" / "recipe").mkdir(parents=True)
    (tmp_path / "myconf" / "recipe" / "faq_sft.yaml").write_text(OWN_RECIPE)
    (tmp_path / "my_sources.py").write_text(OWN_SOURCE)
    words = "where when is the train bus shop open closed today tomorrow at nine ten it".split()

    def question(i: int) -> str:
        return " ".join(words[(i + k) % len(words)] for k in range(6)) + "?"

    def answer(i: int) -> str:
        return " ".join(words[(3 * i + k) % len(words)] for k in range(9)) + "."

    lines = [f"{question(i)}\t{answer(i)}" for i in range(120)]
    (tmp_path / "faq.tsv").write_text("\n".join(lines) + "\n")

    # data.plugins imports code: taken from the command line only, never from a YAML (trainer.cli)
    proc = python_train(
        ["hydra.searchpath=[file://myconf]", "recipe=faq_sft", "data.plugins=[my_sources.py]"], cwd=tmp_path
    )
    assert_ok(proc)
    assert "data faq_lines: 120 records -> 120 examples" in proc.stderr + proc.stdout
    (run,) = (tmp_path / "outputs" / "faq_sft").iterdir()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2
    assert summary["dataset"]["label_tokens"] < summary["dataset"]["tokens"] // 2  # answers only


@pytest.mark.slow
def test_weights_from_a_local_save_pretrained_folder(tmp_path, cache_dir):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.config import DataConfig, ModelConfig
    from trainer.data import load_tokenizer

    tokenizer = load_tokenizer(
        ModelConfig(chat_template="chatml", tokenizer_vocab_size=512),
        DataConfig(source="chat_synthetic", num_records=100, cache_dir=cache_dir),
    )
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "qwen2",
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    saved = tmp_path / "my-tiny-qwen"
    AutoModelForCausalLM.from_config(config).save_pretrained(saved)
    tokenizer.save_pretrained(saved)  # carries its ChatML template

    run_dir = tmp_path / "run"
    proc = python_train(
        # The chat recipe's CPU variant with the real recipe's model group pointed at the folder.
        [
            "recipe=cpu_chat_sft",
            "model=qwen2_5_0_5b_instruct",
            f"model.name_or_path={saved}",
            "data.max_length=512",
            *QUICK,
            f"run_dir={run_dir}",
        ],
        cwd=tmp_path,
    )
    assert_ok(proc)
    log = proc.stderr + proc.stdout
    assert f"model {saved}:" in log  # loaded from the folder, not built from a config
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["dataset"]["label_tokens"] < summary["dataset"]["tokens"]


@pytest.mark.slow
def test_installed_package_finds_configs_and_recipes_without_the_source_tree(tmp_path):
    wheel_dir, site = tmp_path / "wheel", tmp_path / "site"
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(wheel_dir),
            str(REPO),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-2000:]
    (wheel,) = wheel_dir.glob("packfsdp-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "trainer/configs/config.yaml" in names and "trainer/recipes/cpu_chat_sft.yaml" in names
    zipfile.ZipFile(wheel).extractall(site)  # what `pip install` puts in site-packages

    env = os.environ | {"PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"}
    work = tmp_path / "elsewhere"
    work.mkdir()
    probe = "import trainer.compose as c; print(c.__file__); print(c.config_dir()); print(*c.recipe_dirs())"
    out = subprocess.run([sys.executable, "-c", probe], cwd=work, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert all(line.startswith(str(site)) for line in out.stdout.split()), out.stdout
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.train", "recipe=qwen_chat_sft", "--cfg", "job"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert yaml.safe_load(proc.stdout)["name"] == "qwen_chat_sft"
