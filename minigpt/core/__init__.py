"""The maths of minigpt, in one room: read this package first.

- `gpt.py`: the model, top to bottom: `attention()` with both kernels (fused SDPA and the
  explicit softmax that returns the `[batch, head, query, key]` pattern), RoPE, QK-norm, the KV
  cache, then CausalSelfAttention, MLP, Block and GPT. `ForwardSpec.head_hook` is the one
  intervention point for every head experiment.
- `generate.py`: sampling numerics (temperature, top-k, top-p) and `generate` on token ids
  (`sampling.py`: the sampling settings and their checks, without torch, for the CLI).
- `heads.py`: every number about a head alone: attention maps, pattern scores (and the same at
  every offset and lag), ablation effects (`modes.py`: the ablation modes and their check,
  without torch, for the CLI).
- `head_circuits.py`: how heads work together, head by head: direct logit attribution, Q/K/V
  composition scores (weights only), activation patching of each head from a corrupted input.
- `edge_graph.py`: the circuit as a graph of edges (embedding, heads through their q, k and v
  inputs apart, MLPs, logits): EAP and EAP-IG scores, the circuit kept and checked by running
  it, the faithfulness curve (`edge_args.py`: what a search is asked for and the patching
  direction, checked without torch, for the CLI).
- `patching.py`: the one metric type (`Metric`) and the one sweep driver every ablation and
  patching experiment runs its rows through.
- `lens.py`: the logit lens: the residual stream after the embedding and after each layer read
  through the final norm and the unembedding.
- `step.py`: one optimizer step (`train_step`) and one evaluation (`evaluate`).

The heads' outputs `z` (what `ForwardSpec.head_hook` and an `Intervention`'s `heads` see) are
`[batch, head, query, d_head]`, where TransformerLens's `hook_z` is `[batch, pos, head_index,
d_head]`. It is the layout attention computes in: `attention()` (and SDPA) takes q, k, v as
`[batch, head, position, d_head]` and returns z the same way, beside the `[batch, head, query,
key]` pattern, so a head is `z[:, h]` in both and a hook sees z before the one transpose that
merges the heads for W_O (`z.transpose(1, 2).reshape(B, T, C)` in `CausalSelfAttention`).
Changing it would add a transpose each way to every layer of every pass for a hook's
convenience; code compared with TransformerLens transposes once (`z.transpose(1, 2)`).

These files import only torch, the standard library, `minigpt.config.settings` (the settings
dataclasses, no file code) and `minigpt.errors` (tests/test_layout.py checks it): no files,
no events, no run directory, no tokenizer. Every other package (train, run, hf, heads, bench,
cli) is a consumer of this one.
"""
