"""Sparse autoencoders on attention-layer outputs (`minigpt features`), everything around the
maths (which is `minigpt.interp.sae`): the activations an SAE learns from, read through the
forward pass's one intervention point; the training session that collects them, fits or resumes
the SAE and measures it on held-out tokens (`train_features`, what `minigpt features train`
runs, around the inner loop that fits it); the SAE directory in SAELens's layout; and what one
SAE's features are, as data and as the pictures a student reads (`minigpt features show --sae
DIR`, `inspect-heads --features DIR`). docs/internals.md lists the modules.
"""
