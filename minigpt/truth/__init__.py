"""Circuits whose answer is known: RASP programs compiled by tracr into minigpt models, each
with the circuit it computes by construction (`truth.json`), and every finder scored against
it.

- `programs.py`: the built-in programs (`minigpt compile --list`) and a user's program file;
- `tracr_compile.py`: tracr's compiler run on one, its weights and its truth read off tracr's
  graph (needs the optional extra `minigpt-lab[truth]`: tracr, jax, dm-haiku);
- `convert.py`: tracr's weights as minigpt's settings and state dict (numpy and torch only);
- `store.py`: the compiled run written as an ordinary run directory (config, checkpoint,
  tokenizer, metrics) with its truth.json, and truth.json read back;
- `inputs.py`: a compiled run's inputs: random inputs of its vocabulary, the (clean,
  corrupted) pairs and the metric `minigpt circuit` scores them with;
- `scoring.py`: a circuit search scored against the truth (edge AUROC of every finder,
  precision and recall of the circuit, the heads' types against the program's own).
"""
