"""Sparse autoencoders on attention-layer outputs (`minigpt features`): the maths is
`minigpt.core.sae`; here what feeds and reads it.

- `collect.py`: layer L's head outputs z through the one intervention point, over a run's own
  data or a text file; the same point spliced for the loss recovered.
- `train.py`: the training loop (settings, progress events, the resumable training state).
- `build.py`: `train_features`, what `minigpt features train` runs.
- `store.py`: the SAE directory, in SAELens's layout.
- `show.py`: what one SAE's features are: density, top contexts, the heads that write each,
  the tokens each promotes; and the features active on one input (`inspect-heads --features`).
"""
