"""The model, in one room: read this package first. What a decoder-only transformer computes
(the forward pass every command runs: training, sampling, inspection, imported and compiled
models), how it generates, how one optimizer step and one evaluation run, and the hand-written
CPU kernels under it, each the same numbers as the plain torch it replaces. `GPT.forward` reads
top-down in core/gpt.py, like nanoGPT's model.py; `ForwardSpec.intervention` is the one point
where every head or edge experiment reads or changes what a layer writes or reads.

The analyses that read a model (head scores, circuits, the QK split, SAEs) are in
`minigpt.interp`, which imports this room and is never imported by it.

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
no events, no run directory, no tokenizer, no device policy, no analysis. docs/internals.md lists
the modules, generated from their docstrings.
"""
