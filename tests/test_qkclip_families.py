"""QK-Clip over every causal-LM family of the installed transformers, each built tiny from its own config.

The families come from transformers' own registry (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``), each
built from its default config shrunk generically (``hf_families.tiny_config``: width, layers,
heads, experts, vocabulary, per-layer patterns). One row per family (``hf_families.run_family``),
which is one of:

* **supported**: `attach` accepts it; the forward with MuonClip attached equals the model's own
  (its default implementation, eager or SDPA) in eval and in train mode, with one row
  right-padded and one left-padded, and every layer that ran passed its one-time forward check;
  then, with layer 0's heads spread apart, ``MuonClip(lr=0, weight_decay=0)`` records exactly the
  max logits an independent probe measures (``hf_probe``: ``scale * q.k`` in float64 on the
  layer's own inputs, padding queries left out by the batch's own 2-D mask), after one step each
  of layer 0's heads above tau lands on tau, the others keep their max, and every other weight
  element (other heads, V, other layers) is bit-identical; `detach` then gives every (sub-)model
  the implementation it had;
* **refused** before any step, by `attach` or by the first forward, with a ValueError whose
  message names one of the causes of ``hf_families.REFUSAL_CAUSES``;
* **not built**: the family's config cannot be built small (the reason is recorded).

Every row that attaches also checks that routing and the clip see the same maps
(``hf_families.check_routing_agrees``): wherever the clip scales rows of a weight as q or k,
`muonclip.param_groups` makes exactly those rows one matrix (and, with ``per_head=True``, each
head's rows), both being derived from the family table (`muonclip.integrations.families`).
`VARIANTS` adds rows for configurations of a family that its default config does not build
(GPTBigCode without multi-query attention).

A family that is neither supported nor refused fails here, and so does one that cannot be built
small unless the recorded table ``tests/hf_family_table.json`` (written by
``tests/family_table.py``, which also writes the table of docs/integrations.md) says so: a new
transformers release shows up as failing rows rather than silence. Under the transformers version
the table was recorded with, every row must also equal its recorded verdict and cause (a new
family, or a changed verdict, fails).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_families import families, run_family  # noqa: E402

from muonclip.integrations.hf import attach  # noqa: E402
from muonclip.qkclip import StridedRows  # noqa: E402

TABLE = Path(__file__).with_name("hf_family_table.json")
RECORDED = json.loads(TABLE.read_text(encoding="utf-8"))


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: one thread each (xdist runs one worker per core)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


SAME_VERSION = RECORDED["transformers"] == transformers.__version__


@pytest.mark.parametrize("family", sorted(set(families()) | (set(RECORDED["rows"]) if SAME_VERSION else set())))
def test_family_row(family):
    if family not in families():
        pytest.fail(f"{family} is in the recorded table but not in transformers {transformers.__version__}'s "
                    "registry: regenerate the table (python tests/family_table.py)")
    row = run_family(family)  # AssertionError: neither supported nor refused with a named cause
    recorded = RECORDED["rows"].get(family)
    if row.verdict == "not built":  # accepted only where recorded: a family must not drop out silently
        assert recorded is not None and recorded["verdict"] == "not built", (
            f"{family} cannot be built small under transformers {transformers.__version__}: {row.why}")
    if not SAME_VERSION:  # another release: the row must still be supported or refused (checked above)
        return
    assert recorded is not None, (
        f"{family} ({row.verdict}: {row.why}) is not in the recorded table: review it and regenerate the table "
        "(python tests/family_table.py)")
    assert (row.verdict, row.why) == (recorded["verdict"], recorded["why"]), (
        f"{family}: recorded {recorded['verdict']} ({recorded['why']}), now {row.verdict} ({row.why}): "
        f"{row.detail}")


VARIANTS = {"gpt_bigcode, multi-head": ("gpt_bigcode", {"multi_query": False})}
"""Configurations of a family beyond its default one: name -> (family, config keywords)."""


@pytest.mark.parametrize("name", list(VARIANTS))
def test_family_variant_row(name):
    """GPTBigCode's multi-head ``c_attn`` interleaves q, k and v per head (its multi-query one
    stacks them): supported by the same criteria as a family row, routing split included."""
    family, variant = VARIANTS[name]
    row = run_family(family, variant)
    assert row.verdict == "supported", (name, row)


def test_gpt_neox_strided_rows_are_the_q_and_k_its_forward_uses():
    """The layout's q/k rows of query_key_value (weight and bias) are exactly what GPT-NeoX's forward
    splits off as each head's query and key (independent of the clip: the model's own view/chunk)."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                             num_attention_heads=4, rotary_pct=0.5))
    with torch.no_grad():
        model.gpt_neox.layers[0].attention.query_key_value.bias.normal_()
    layer = attach(model)[0]
    f = model.gpt_neox.layers[0].attention.query_key_value
    lay = layer.layout
    assert isinstance(lay.q_weight, StridedRows) and lay.q_weight.tensor is f.weight and lay.q_bias.tensor is f.bias
    x = torch.randn(5, 32)
    with torch.no_grad():
        qkv = f(x).view(5, 4, 3 * 8)  # as GPTNeoXAttention.forward: (..., heads, 3 * head_size), chunk(3)
        q, k, v = qkv.chunk(3, dim=-1)
        for t, bias, ref in ((lay.q_weight, lay.q_bias, q), (lay.k_weight, lay.k_bias, k)):
            idx = t.indices()
            torch.testing.assert_close(x @ f.weight[idx].T + f.bias[idx], ref.reshape(5, -1), rtol=1e-6, atol=1e-6)
            assert torch.equal(bias.indices(), idx)
        v_rows = torch.ones(96, dtype=torch.bool)
        v_rows[lay.q_weight.indices()] = False
        v_rows[lay.k_weight.indices()] = False
        torch.testing.assert_close(x @ f.weight[v_rows].T + f.bias[v_rows], v.reshape(5, -1), rtol=1e-6, atol=1e-6)
