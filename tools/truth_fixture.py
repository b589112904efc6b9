"""Write the quick tier's compiled-program fixtures (tests/fixtures/compiled/<program>/): the
built-in programs `induction` (categorical, two heads composing) and `frac_prevs` (numerical,
an MLP feeding a head) compiled by tracr, stored so that the quick tier tests the conversion
without tracr or jax:

- `tracr_params.safetensors`: tracr's weights in its own names ("transformer/layer_0/attn/
  query/w", ...);
- `compiled.json`: the program, the residual stream's labels, the input ids, the output, the
  model's dimensions, the truth (truth.json's nodes, edges and directions) and the inputs;
- `tracr_outputs.safetensors`: tracr's own forward pass on those inputs: the residual stream
  after every half-layer (`residual_I`, (N, T, d_model): I = 2L after layer L's attention,
  2L + 1 after its MLP) and its output (`output`, (N, T)).

Needs tracr (pip install 'minigpt-lab[truth]'). Run from the repository root:

    python tools/truth_fixture.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from minigpt.truth.programs import BUILT_IN
from minigpt.truth.tracr_compile import compile_program, random_inputs

PROGRAMS = ("induction", "frac_prevs")
N_INPUTS = 16


def write(name: str, out: Path) -> None:
    import jax.numpy as jnp

    program = BUILT_IN[name]
    c = compile_program(program)
    inputs = random_inputs(program, N_INPUTS, seed=1)
    ids = [[c.input_ids[t] for t in row] for row in inputs]
    ran = c.model.forward(c.model.params, jnp.array(ids))
    residuals = [np.asarray(r, dtype=np.float32) for r in ran.transformer_output.residuals]
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in c.params.items()},
              str(out / "tracr_params.safetensors"))
    save_file({**{f"residual_{i}": r for i, r in enumerate(residuals)},
               "output": np.asarray(ran.unembedded_output, dtype=np.float32)},
              str(out / "tracr_outputs.safetensors"))
    doc = {"program": {"name": name, "summary": program.summary, "source": program.source,
                       "vocab": list(program.vocab), "max_seq_len": program.max_seq_len,
                       "bos": "BOS"},
           "residual": c.residual, "input_ids": c.input_ids, "output": c.output,
           "dims": c.dims, "truth": c.truth, "inputs": inputs}
    (out / "compiled.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    for program in PROGRAMS:
        write(program, ROOT / "tests" / "fixtures" / "compiled" / program)
