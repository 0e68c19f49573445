"""The MoE router aux (load-balancing) loss the config asks for is trained (``trainer.router_aux``): on one example
the step's objective is transformers' own ``outputs.loss`` (value and every gradient) for every family whose
forward adds one, on both loss paths; pads never enter the statistic and a packed batch gives the padded
batch's value and gradient on the same tokens; the step weighs micro-batches by their real tokens; the
metrics carry it apart from the token loss; what packfsdp cannot train is refused or said once; the startup
self-check checks it apart and catches pads in the statistic; a real Trainer's step-1 loss on one example is
transformers' loss."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.conftest import compose_job
from tests.faults.conftest import one_rank_world
from trainer.collate import Batch
from trainer.config import ConfigError
from trainer.data.examples import IGNORE_INDEX
from trainer.errors import SelfCheckError
from trainer.metrics import RunSummary, StepMetrics, format_step
from trainer.model.certification import check_model, packed_batch
from trainer.model.certification.replica import build_replica
from trainer.model.certification.shrink import default_config, replica_config
from trainer.router_aux import RouterAux, RouterAuxTerm, RouterStats, refuse_untrained_losses, use_router_aux
from trainer.throughput import StepCounts

AUX_FAMILIES = (
    "mixtral",
    "olmoe",
    "qwen3_moe",
    "qwen2_moe",
    "phimoe",
    "granitemoe",
    "granitemoeshared",
    "jetmoe",
    "ernie4_5_moe",
    "flex_olmo",
    "laguna",
    "mellum",
    "minimax_m2",
    "minimax_m3_vl_text",
)
"""The exact families whose ``*ForCausalLM`` adds a load-balancing loss (transformers 5.17 to 5.25)."""
ASK = dict(output_router_logits=True, router_aux_loss_coef=0.01, aux_loss_coef=0.01)
LENGTHS = (9, 1, 14, 5)


def moe(family: str = "mixtral", impl: str = "chunked", **overrides):
    # a window shorter than the context is refused
    window = {"sliding_window": 64, "max_position_embeddings": 64} if family == "phimoe" else {}
    model = build_replica(replica_config(default_config(family, **(ASK | window | overrides))), torch.float32)
    model.use_loss(impl)
    return model


def examples(lengths=LENGTHS, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=g) for n in lengths]


def padded_batch(seqs: list[torch.Tensor]) -> Batch:
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, IGNORE_INDEX)
    for row, s in enumerate(seqs):
        ids[row, : len(s)], mask[row, : len(s)], labels[row, 1 : len(s)] = s, 1, s[1:]
    return Batch(
        ids,
        labels,
        torch.arange(width).expand_as(ids).contiguous(),
        attention_mask=mask,
        num_examples=len(seqs),
        num_tokens=int(mask.sum()),
        num_label_tokens=int((labels != IGNORE_INDEX).sum()),
        num_positions=ids.numel(),
    )


def objective(model, batch: Batch) -> torch.Tensor:
    """A one-micro-batch step's objective, as the loop takes it (token loss / labels + coef x its aux share)."""
    loss_sum, stats = model.token_loss(**batch.model_inputs(), labels=batch.labels, router=True)
    aux = model.router_aux.step_share(stats, batch.num_tokens, batch.num_tokens)
    return loss_sum / batch.num_label_tokens + model.router_aux.coef * aux


def grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return out


def records_router_logits(model) -> bool:
    """Does transformers' own decoder return router logits when asked (5.17's GraniteMoE does not)?"""
    ids = torch.arange(4)[None]
    return bool(model.model.model(input_ids=ids, output_router_logits=True).router_logits)


@pytest.mark.parametrize("impl", ["chunked", "naive"])
@pytest.mark.parametrize("family", AUX_FAMILIES)
def test_one_example_objective_is_transformers_loss(family, impl):
    try:
        model = moe(family, impl)
    except ValueError as e:  # a family the installed transformers does not have
        pytest.skip(str(e)[:80])
    if not records_router_logits(model):
        with pytest.raises(ConfigError, match="records no router logits"):
            use_router_aux(model, cp=1, objective="sft")
        return
    assert use_router_aux(model, cp=1, objective="sft") == model.router_aux
    batch = packed_batch(examples((17,)))
    ours = objective(model, batch)
    ours.backward()
    ours_grads = grads(model)
    inputs = model.attention_inputs(batch.input_ids, batch.position_ids, None, None, torch.ones_like(batch.input_ids))
    theirs = model.model(**inputs, labels=batch.labels, output_router_logits=True)
    assert theirs.aux_loss is not None and float(theirs.aux_loss.detach()) > 0
    torch.testing.assert_close(ours, theirs.loss, rtol=1e-6, atol=1e-6)
    theirs.loss.backward()
    theirs_grads = grads(model)
    assert ours_grads.keys() == theirs_grads.keys()
    for name, g in theirs_grads.items():
        torch.testing.assert_close(ours_grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_the_aux_changes_the_router_gradients():
    """Without the term the router's gradient is the token loss's alone: the aux must move it."""
    model = moe()
    use_router_aux(model, cp=1, objective="sft")
    batch = packed_batch(examples((17,)))
    objective(model, batch).backward()
    with_aux = grads(model)
    (model.token_loss(**batch.model_inputs(), labels=batch.labels) / batch.num_label_tokens).backward()
    without = grads(model)
    routers = [n for n in with_aux if "gate" in n and "experts" not in n]
    assert routers and all(not torch.allclose(with_aux[n], without[n]) for n in routers)


@pytest.mark.parametrize("impl", ["chunked", "naive"])
def test_packed_equals_padded_on_the_same_tokens_and_pads_never_count(impl):
    model = moe(impl=impl)
    use_router_aux(model, cp=1, objective="sft")
    seqs = examples()
    values, gradients = [], []
    for batch in (packed_batch(seqs), padded_batch(seqs)):
        _, stats = model.token_loss(**batch.model_inputs(), labels=batch.labels, router=True)
        assert float(stats.rows) == sum(LENGTHS) * model.config.num_hidden_layers
        values.append(stats.balance_loss())
        values[-1].backward()
        gradients.append(grads(model))
    torch.testing.assert_close(values[0], values[1], rtol=1e-6, atol=0)
    for name, g in gradients[1].items():
        torch.testing.assert_close(gradients[0][name], g, rtol=1e-4, atol=1e-7, msg=name)
    padded = padded_batch(seqs)
    inputs = model.attention_inputs(padded.input_ids, padded.position_ids, None, None, padded.attention_mask)
    theirs = model.model(**inputs, output_router_logits=True)  # transformers masks pads with the attention mask
    torch.testing.assert_close(values[1], theirs.aux_loss.float(), rtol=1e-6, atol=0)
    with_pads = model.router_aux.statistics(theirs.router_logits, None).balance_loss().detach()
    assert abs(float(with_pads) - float(values[1].detach())) > 1e-4  # pads would move it: they are masked, not absent


def test_step_weighs_microbatches_by_their_real_tokens():
    torch.manual_seed(0)
    aux = RouterAux(coef=0.01, num_experts=4, top_k=2)
    logits = [torch.randn(n, 4, requires_grad=True) for n in (30, 10)]
    parts = [aux.statistics((x,), None) for x in logits]
    whole = aux.statistics((torch.cat(logits),), None)
    merged = RouterStats.merged(parts)
    torch.testing.assert_close(merged.balance_loss(), whole.balance_loss())
    shares = parts[0].with_counts_of(merged) + parts[1].with_counts_of(merged)
    torch.testing.assert_close(shares, whole.balance_loss())  # the self-check's reference: the same value
    step = aux.step_share(parts[0], 30, 40) + aux.step_share(parts[1], 10, 40)
    expected = (30 * parts[0].balance_loss() + 10 * parts[1].balance_loss()) / 40
    torch.testing.assert_close(step, expected)
    one_pad = torch.randn(1, 4, requires_grad=True)
    share = aux.step_share(aux.statistics((one_pad,), None), 0, 40)
    share.backward()
    assert float(share.detach()) == 0.0 and not one_pad.grad.any()  # a filler micro-batch weighs nothing


def step_record(router_aux=None) -> StepMetrics:
    """A step's record as the loop makes it: the objective's fields (``SFT``: with the router term, ``RouterAuxTerm``
    over the step's aux shares) from the global loss sum 250 over 100 label tokens."""
    counts = StepCounts(
        label_tokens=100,
        tokens=120,
        positions=128,
        padded_equivalent_positions=150,
        sum_squared_lengths=5000,
        units=100,
    )
    fields = {"loss": 250.0 / counts.units}
    if router_aux is not None:
        term = RouterAuxTerm(RouterAux(coef=router_aux[1], num_experts=4, top_k=2))
        term.aux_sum = torch.tensor(router_aux[0])
        fields = term.step_metrics(fields["loss"], torch.device("cpu"))  # no process group: the sums are this rank's
    return StepMetrics.measure(
        counts,
        step=1,
        epoch=0,
        lr=1e-3,
        grad_norm=1.0,
        skipped=None,
        step_time_s=0.5,
        model_flops=1e9,
        peak_mem_gib=0.1,
        tokens_seen_before=0,
        **fields,
    )


def test_metrics_carry_the_aux_apart_from_the_token_loss():
    m = step_record(router_aux=(2.0, 0.01))
    assert m.token_loss == 2.5 and m.aux_loss == 2.0 and m.loss == pytest.approx(2.5 + 0.01 * 2.0)
    assert {"token_loss", "aux_loss"} <= m.to_json().keys() and StepMetrics.from_json(m.to_json()).aux_loss == 2.0
    assert "token 2.5000 aux 2.0000" in format_step(m)
    summary = RunSummary(skip=0)
    summary.add(m)
    assert summary.result()["final_aux_loss"] == 2.0 and summary.result()["final_token_loss"] == 2.5
    plain = step_record()
    assert plain.loss == 2.5 and not {"token_loss", "aux_loss"} & plain.to_json().keys()
    plain_summary = RunSummary(skip=0)
    plain_summary.add(plain)
    assert "final_aux_loss" not in plain_summary.result() and "aux" not in format_step(plain)


def test_what_packfsdp_does_not_train_is_refused_or_said_once(caplog):
    model = moe()
    with pytest.raises(ConfigError, match=r"parallel.cp=2.*use parallel.cp=1"):
        use_router_aux(model, cp=2, objective="sft")
    with pytest.raises(ConfigError, match="objective=dpo"):
        use_router_aux(model, cp=1, objective="dpo")
    with caplog.at_level(logging.INFO, logger="trainer.router_aux"):
        assert use_router_aux(moe(router_aux_loss_coef=0.0, aux_loss_coef=0.0), cp=1, objective="sft").coef == 0.0
        assert use_router_aux(moe(output_router_logits=False), cp=1, objective="sft") is None
        assert use_router_aux(moe("deepseek_v3"), cp=1, objective="sft") is None
    said = [r.getMessage() for r in caplog.records]
    assert any("coefficient 0: the load-balancing loss is logged, not trained" in s for s in said)
    assert any(
        "router aux loss: off (router_aux_loss_coef=0.01 applies only with output_router_logits" in s for s in said
    )
    assert any("DeepseekV3ForCausalLM adds no auxiliary loss" in s for s in said)
    config = default_config("mixtral")
    config.z_loss_coefficient = 0.1  # Bamba's z-loss on the logits
    with pytest.raises(ConfigError, match="z_loss_coefficient=0.1.*does not train it"):
        refuse_untrained_losses(config)


@pytest.mark.parametrize("padded", [False, True])
def test_self_check_checks_the_aux_apart(padded, monkeypatch):
    model = moe()
    use_router_aux(model, cp=1, objective="sft")
    seqs = examples()
    batch = padded_batch(seqs) if padded else packed_batch(seqs)
    check_model(model, batch, None, None)  # passes, with the aux compared
    if not padded:
        return
    original = RouterAux.statistics
    monkeypatch.setattr(RouterAux, "statistics", lambda self, logits, mask: original(self, logits, None))
    with pytest.raises(
        SelfCheckError, match=r"router aux loss \(the batch's statistic vs its examples alone\) relative diff 0\.00"
    ):
        check_model(model, batch, None, None)


def test_trainer_step_one_loss_is_transformers_loss_on_one_example(tmp_path):
    """A real Trainer (one gloo rank, FSDP2, fp32) on one-example micro-batches: its logged step-1 loss is
    transformers' ``outputs.loss`` of that example with the same initial weights."""
    from trainer.loop import Trainer
    from trainer.model import build_model

    overrides = [
        "model=qwen2_tiny",
        "model.family=mixtral",
        "data.num_records=40",
        "max_steps=1",
        "grad_accum=1",
        "model.config_overrides={num_local_experts:4,num_experts_per_tok:2,output_router_logits:true,"
        "router_aux_loss_coef:0.05}",
        "packing.max_examples_per_bin=1",
        "parallel.param_dtype=float32",
        "logger.peak_tflops=1",
        "eval.holdout_fraction=0",
        f"run_dir={tmp_path}",
    ]
    with one_rank_world():
        trainer = Trainer(compose_job(overrides))
        batches = trainer.next_step_batches()
        assert len(batches) == 1 and batches[0].num_examples == 1
        trainer.next_step_batches = lambda: batches
        reference = build_model(trainer.cfg.model, trainer.tokenizer, trainer.backend, trainer.cfg.seed)
        batch = batches[0]
        inputs = reference.attention_inputs(
            batch.input_ids, batch.position_ids, None, None, torch.ones_like(batch.input_ids)
        )
        with torch.no_grad():
            theirs = reference.model(**inputs, labels=batch.labels, output_router_logits=True)
        metrics = trainer.train_step()
        trainer.metrics.close()
    assert metrics.aux_loss == pytest.approx(float(theirs.aux_loss), rel=1e-5)
    assert metrics.loss == pytest.approx(float(theirs.loss), rel=1e-6)
    assert metrics.loss != pytest.approx(metrics.token_loss, rel=1e-3)
