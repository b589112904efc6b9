"""The maths of inspection, in its own room above the model: every number minigpt reports
about what a head does and how heads work together, computed from a model (`minigpt.core`) and
token ids. Head scores and ablation, direct logit attribution, composition and activation
patching, the circuit as a graph of edges (EAP, EAP-IG, the faithfulness curve), the logit lens,
the exact query x key split of an attention score, sparse autoencoders: each with its definition
stated beside its code, and each experiment run through the forward pass's one intervention
point (`core.gpt.Intervention`) by the one sweep driver and scored by the one metric type
(`interp.patching`). Each analysis keeps the formula of its own cost beside its maths (a `Cost`);
whether a cost is allowed is policy (`minigpt.cost`), decided by the caller.

These files import only torch, the standard library, the settings dataclasses, the errors,
`minigpt.core`, each other and the `Cost` type (tests/test_layout.py checks it): no files, no
events, no run directory, no rendering. Data in, data out: `minigpt.heads` and
`minigpt.features` feed them inputs and write their files, `minigpt.cli` prints them. Every
quantity is checked against TransformerLens in the slow tier (tests/test_transformer_lens*.py).
"""
