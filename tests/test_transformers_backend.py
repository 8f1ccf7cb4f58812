"""flash_hopper.integrations.transformers on CPU (docs/integrations.md): registration, and the
argument mapping checked end to end. The library's flash_attn_func / flash_attn_varlen_func are
replaced by the fp32 references (reference.py), which record their arguments; tiny randomly
initialized models then run with attn_implementation=register() against transformers' own
"sdpa" / "eager" on the same weights. Grid: a Llama-style model (GQA 4 / 2 heads) dense, left-
padded, packed and generating with dynamic and static caches; a Gemma-2-style one (sliding
window 4 on alternate layers, logit softcap, query_pre_attn_scalar scale) on 12 tokens, so the
window bites."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from flash_hopper import interface, reference
from flash_hopper.integrations import transformers as fh_transformers

transformers = pytest.importorskip("transformers")

ATOL = 2e-5  # fp32 against fp32: summation order only


@pytest.fixture
def calls(monkeypatch):
    """The library's entry points replaced by fp32 references; yields the recorded calls."""
    recorded: list[tuple[str, dict]] = []

    def dense(q, k, v, sinks=None, **options):
        sink = {} if sinks is None else {"sinks": sinks}
        recorded.append(("dense", {"heads": (q.shape[2], k.shape[2]), **sink, **options}))
        if sinks is not None:  # the library's composition over the reference's (out, lse)
            return interface._with_sinks(lambda: reference.attention_ref(q, k, v, **options),
                                         sinks, q, 1, False).to(q.dtype)
        return reference.attention_ref(q, k, v, **options)[0].to(q.dtype)

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, **options):
        recorded.append(("varlen", {"cu_seqlens": (cu_q.tolist(), cu_k.tolist()),
                                    "max_seqlen": (max_q, max_k), **options}))
        return reference.attention_varlen_ref(q, k, v, cu_q, cu_k, **options)[0].to(q.dtype)

    monkeypatch.setattr(interface, "flash_attn_func", dense)
    monkeypatch.setattr(interface, "flash_attn_varlen_func", varlen)
    fh_transformers.register()
    yield recorded


def twins(config, baseline):
    """The same randomly initialized weights under flash_hopper and under ``baseline``."""
    torch.manual_seed(0)
    build = transformers.AutoModelForCausalLM.from_config  # sets the implementation on the config
    ours = build(copy.deepcopy(config), attn_implementation=fh_transformers.NAME)
    theirs = build(copy.deepcopy(config), attn_implementation=baseline)
    theirs.load_state_dict(ours.state_dict())
    return ours.eval(), theirs.eval()


def llama_config():
    return transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, vocab_size=128)


def gemma2_config():
    return transformers.Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                     vocab_size=128, sliding_window=4, query_pre_attn_scalar=24,
                                     attn_logit_softcapping=20.0, final_logit_softcapping=None)


def test_register_adds_the_attention_and_its_mask():
    assert fh_transformers.register() == "fh_attention"
    assert transformers.AttentionInterface._global_mapping["fh_attention"] is \
        fh_transformers.attention_forward
    assert transformers.AttentionMaskInterface._global_mapping["fh_attention"] is \
        fh_transformers.key_mask


def test_register_refuses_a_flash_name_where_transformers_reserves_it(monkeypatch):
    # transformers 5 loads any attn_implementation containing "flash" as FlashAttention (a package
    # or a hub kernel) at model construction; 4.x reserved only "flash_attention_N"
    monkeypatch.setattr(transformers, "__version__", "5.17.0")
    with pytest.raises(ValueError, match=r"^name: transformers 5.17.0 loads .* containing "
                                         r"'flash' .* got 'flash_hopper'$"):
        fh_transformers.register("flash_hopper")
    assert fh_transformers.register() == "fh_attention"
    monkeypatch.setattr(transformers, "__version__", "4.57.1")
    assert fh_transformers.register("flash_hopper") == "flash_hopper"


def test_register_keeps_the_former_name_on_4x(monkeypatch):
    mapping = transformers.AttentionInterface._global_mapping
    monkeypatch.setattr(transformers, "__version__", "4.57.1")
    monkeypatch.delitem(mapping, "flash_hopper", raising=False)
    assert fh_transformers.register() == "fh_attention"
    assert mapping["flash_hopper"] is fh_transformers.attention_forward
    monkeypatch.setattr(transformers, "__version__", "5.17.0")
    monkeypatch.delitem(mapping, "flash_hopper")
    fh_transformers.register()
    assert "flash_hopper" not in mapping


# The mask hook's query positions, as each transformers major passes them (by keyword): 4.x the
# positions themselves (cache_position), 5.x the first one and the count (q_offset, a tensor for a
# static cache, and q_length). Rows: a prefill of 4 with left padding, a decode step into a static
# cache of 8 slots (its unfilled tail cut off), a sliding layer's slice from key 3 on.
@pytest.mark.parametrize(("first", "count", "kv_length", "kv_offset", "expect"), [
    (0, 4, 4, 0, [[False, True, True, True], [True, True, True, True]]),
    (5, 1, 8, 0, [[False, True, True, True, True, True], [True] * 6]),
    (6, 1, 4, 3, [[True, True, True, True], [True, True, True, False]]),
])
def test_key_mask_takes_either_majors_query_positions(first, count, kv_length, kv_offset, expect):
    padding = torch.ones(2, 7, dtype=torch.long)
    padding[0, 0] = 0
    padding[1, 6] = 0  # a right-padded token, past the decode step's keys but in the slice's
    old = fh_transformers.key_mask(batch_size=2, cache_position=torch.arange(first, first + count),
                                   kv_length=kv_length, kv_offset=kv_offset,
                                   attention_mask=padding)
    new = fh_transformers.key_mask(batch_size=2, q_length=count, q_offset=torch.tensor(first),
                                   kv_length=kv_length, kv_offset=kv_offset,
                                   attention_mask=padding, device=torch.device("cpu"))
    assert old.tolist() == new.tolist() == expect
    full = torch.ones(2, kv_offset + kv_length, dtype=torch.long)
    for positions in ({"cache_position": torch.arange(first, first + count)},
                      {"q_length": count, "q_offset": first}):
        unpadded = fh_transformers.key_mask(batch_size=2, kv_length=kv_length,
                                            kv_offset=kv_offset, attention_mask=full,
                                            **positions)
        filled = min(kv_length, first + count - kv_offset)
        assert (unpadded is None) == (filled == kv_length)
    with pytest.raises(TypeError, match="expected the queries' positions as cache_position"):
        fh_transformers.key_mask(batch_size=2, kv_length=4, attention_mask=padding)


def test_without_transformers_register_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    with pytest.raises(ImportError, match=r"needs the transformers package \(>= 4.48\): pip "
                                          r"install 'flash-hopper\[transformers\]'"):
        fh_transformers.register()


def test_llama_dense_batch_maps_scale_causal_and_gqa(calls):
    ours, theirs = twins(llama_config(), "sdpa")
    ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, atol=ATOL, rtol=0)
    assert [kind for kind, _ in calls] == ["dense", "dense"]  # one per layer
    options = calls[0][1]
    assert options == {"heads": (4, 2), "softmax_scale": 16 ** -0.5, "causal": True,
                       "window_size": (-1, -1), "softcap": 0.0}


def test_llama_padded_batch_runs_varlen_on_the_tokens(calls):
    ours, theirs = twins(llama_config(), "sdpa")
    ids = torch.randint(0, 128, (3, 7))
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    mask[2, 5:] = 0  # right padding (a training batch)
    with torch.no_grad():
        got = ours(ids, attention_mask=mask).logits
        want = theirs(ids, attention_mask=mask).logits
    valid = mask.bool()
    torch.testing.assert_close(got[valid], want[valid], atol=ATOL, rtol=0)
    kind, options = calls[0]
    assert kind == "varlen" and options["cu_seqlens"] == ([0, 7, 11, 16], [0, 7, 11, 16])
    assert options["max_seqlen"] == (7, 7) and options["causal"]


def test_llama_packed_position_ids_keep_sequences_apart(calls):
    ours, theirs = twins(llama_config(), "sdpa")
    ids = torch.randint(0, 128, (1, 11))
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        got = ours(ids, position_ids=positions).logits
        first, second = (theirs(ids[:, s]).logits for s in (slice(0, 4), slice(4, 11)))
    torch.testing.assert_close(got, torch.cat([first, second], 1), atol=ATOL, rtol=0)
    assert calls[0][0] == "varlen" and calls[0][1]["cu_seqlens"] == ([0, 4, 11], [0, 4, 11])


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_llama_generate_matches_sdpa(calls, cache):
    ours, theirs = twins(llama_config(), "sdpa")
    ids = torch.randint(0, 128, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[0, :2] = 0  # left padding, as generate expects
    options = {"max_new_tokens": 8, "do_sample": False, "attention_mask": mask,
               "pad_token_id": 0, "cache_implementation": cache}
    got = ours.generate(ids, **options)
    want = theirs.generate(ids, **options)
    assert torch.equal(got, want)
    # padding (and a static cache's unfilled slots) on every step: 2 layers x (1 + 7 steps)
    assert [kind for kind, _ in calls] == ["varlen"] * 16


def test_gemma2_window_softcap_and_scale(calls):
    config = gemma2_config()
    ours, theirs = twins(config, "eager")
    ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, atol=ATOL, rtol=0)
    windows = [options["window_size"] for _, options in calls]
    assert windows == [(3, 0) if t == "sliding_attention" else (-1, -1)
                       for t in config.layer_types]
    assert {(o["softcap"], o["softmax_scale"], o["causal"]) for _, o in calls} == {
        (20.0, 24 ** -0.5, True)}


def test_gemma2_padded_generate_matches_eager(calls):
    ours, theirs = twins(gemma2_config(), "eager")
    ids = torch.randint(0, 128, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :4] = 0
    options = {"max_new_tokens": 8, "do_sample": False, "attention_mask": mask, "pad_token_id": 0}
    assert torch.equal(ours.generate(ids, **options), theirs.generate(ids, **options))
    # the prefill is padded; a sliding layer's later steps see only its window's keys, past the
    # padding, so they run dense
    assert len(calls) == 16 and calls[0][0] == calls[1][0] == "varlen"


class _Layer(torch.nn.Module):
    is_causal = True


def test_dropout_is_refused():
    q = torch.zeros(1, 2, 3, 16)
    with pytest.raises(ValueError, match="^dropout: .* expected 0.0 .* got 0.1$"):
        fh_transformers.attention_forward(_Layer(), q, q, q, None, dropout=0.1)


def test_sinks_as_gpt_oss_computes_them(calls):
    # gpt-oss passes its sink parameter (model dtype, one per query head) as s_aux; its eager
    # attention appends it to every row's logits as a column without a value
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 16) for _ in range(3))  # (batch, heads, seq, d)
    s_aux = torch.tensor([0.5, -1.25], dtype=torch.bfloat16)
    got, _ = fh_transformers.attention_forward(_Layer(), q, k, v, None, scaling=0.25, s_aux=s_aux)
    (kind, options), = calls
    assert kind == "dense" and options["sinks"].dtype == torch.float32
    logits = (q @ k.transpose(-1, -2)) * 0.25
    logits = logits.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
    sink = s_aux.float().view(1, 2, 1, 1).expand(1, 2, 5, 1)
    probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
    torch.testing.assert_close(got, (probs @ v).transpose(1, 2), atol=ATOL, rtol=0)


def test_a_4d_mask_reduces_to_the_keys_some_query_sees():
    visible = torch.tensor([[False, True, True], [False, False, True]])
    additive = torch.zeros(1, 1, 2, 3).masked_fill(~visible, float("-inf"))
    expect = torch.tensor([[False, True, True]])
    assert torch.equal(fh_transformers._keys_taking_part(additive), expect)
    assert torch.equal(fh_transformers._keys_taking_part(visible[None, None]), expect)
