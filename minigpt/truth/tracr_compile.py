"""A RASP program compiled by tracr, with its truth: `compile_program` runs tracr's compiler
(the steps of `compiling.compile_rasp_to_model`, kept apart so that its graph and its blocks
stay at hand), with `causal=True` and `compiler_bos="BOS"`, and returns the weights (numpy, in
tracr's names) beside the known circuit in minigpt's names.

The truth comes from tracr's graph of the program and the blocks it compiled each operation
into, never from running a finder:

- the nodes: which RASP operation each head and each MLP computes (`L{l}.H{h}` is head h of
  tracr's attention layer l, `L{l}.MLP` its MLP layer l: minigpt's block l is tracr's layer l);
  a SelectorWidth is a head and an MLP together;
- the residual stream's directions (tracr's basis: `tokens:a`, `indices:3`, `one`, a
  categorical variable's `name:value`, a numerical variable's `name`) and who writes them: the
  embedding (`embed`: tokens, indices, one) or the block whose output matrix is non-zero there;
- the edges: a reader (a head's q, k or v input, an MLP's input, the logits) whose input matrix
  is non-zero on a direction takes it from every writer of that direction upstream of it;
  each edge names the variables it carries and whether they change with the input tokens
  (`tokens`) or only with positions and constants (indices, `one`, the BOS token's direction,
  and anything computed from those alone).

Head kinds: a head whose selector (evaluated with RASP on random inputs, keys after the query
masked as a causal model masks them) selects exactly the previous position is `previous`; one
that selects exactly the positions after earlier occurrences of the query's token is
`induction`. Needs tracr (`programs.tracr_modules`).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import numpy as np

from minigpt.display import head_name, mlp_name
from minigpt.errors import MinigptError
from minigpt.truth.programs import BOS, PAD, Program, tracr_modules

KIND_INPUTS = 200  # random inputs each head's selector is classified on


@dataclass
class Compiled:
    """A compiled program: tracr's weights `params` ({"layer/param": array}, e.g.
    "transformer/layer_0/attn/query/w"), the residual stream's direction labels, the input ids
    (token -> id: BOS, the padding token and the vocabulary, as tracr's encoder numbers them),
    the output (its kind, variable, the labels of the directions the logits read, and, when
    categorical, the value each reads), the model's dimensions, the truth (module docstring)
    and tracr's own model (`model.apply`, for the checks)."""

    program: Program
    params: dict[str, np.ndarray]
    residual: list[str]
    input_ids: dict[str, int]
    output: dict
    dims: dict[str, int]
    truth: dict
    model: object = None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


def compile_program(program: Program) -> Compiled:
    """Compile `program` with tracr (causal, BOS first) and read off its truth; MinigptError
    when tracr cannot compile it (its own message, one line)."""
    rasp, t = tracr_modules()
    t0 = time.perf_counter()
    expr = program.build()
    unsupported = t["validating"].static_validate(expr)
    if unsupported:
        why = "; ".join(f"{u.expr.name}: {u.reason}" for u in unsupported[:3])
        raise MinigptError(f"program {program.name}: tracr cannot compile it ({why})")
    try:
        graph, sink, craft, assembled = _compile(rasp, t, expr, program)
    except (NotImplementedError, ValueError, KeyError, AssertionError) as e:
        text = str(e).strip().splitlines()
        raise MinigptError(f"program {program.name}: tracr failed to compile it "
                           f"({type(e).__name__}: {text[0][:200] if text else 'no message'})"
                           ) from None
    cfg = assembled.model_config
    params = {f"{k}/{p}": np.asarray(v, dtype=np.float32)
              for k, d in assembled.params.items() for p, v in d.items()}
    residual = list(assembled.residual_labels)
    enc = assembled.input_encoder.encoding_map
    categorical = rasp.is_categorical(sink[t["nodes"].EXPR])
    out_dirs = list(sink[t["nodes"].OUTPUT_BASIS])
    output = {"kind": "categorical" if categorical else "numerical",
              "variable": sink[t["nodes"].ID], "name": sink[t["nodes"].EXPR].name,
              "directions": [str(d) for d in out_dirs],
              "values": [_jsonable(d.value) for d in out_dirs] if categorical else None}
    dims = {"n_layer": cfg.num_layers, "n_head": cfg.num_heads, "head_dim": cfg.key_size,
            "mlp_hidden": cfg.mlp_hidden_size, "n_embd": len(residual),
            "vocab_size": len(enc), "block_size": program.max_seq_len + 1}
    truth = read_truth(rasp, t, graph, craft, residual, out_dirs, program)
    return Compiled(program, params, residual, {str(k): int(v) for k, v in enc.items()},
                    output, dims, truth, assembled, time.perf_counter() - t0)


def _compile(rasp, t, expr, program: Program):
    """tracr's compile_rasp_to_model, step by step: (graph, sink, craft model, assembled)."""
    extracted = t["rasp_to_graph"].extract_rasp_graph(expr)
    graph, sources, sink = extracted.graph, extracted.sources, extracted.sink
    t["basis_inference"].infer_bases(graph, sink, set(program.vocab), program.max_seq_len)
    bos_dir = t["bases"].BasisDirection(rasp.tokens.label, BOS)
    t["expr_to_craft_graph"].add_craft_components_to_rasp_graph(graph, bos_dir=bos_dir,
                                                                 mlp_exactness=100)
    craft = t["craft_graph_to_model"].craft_graph_to_model(graph, sources)
    assembled = t["craft_model_to_transformer"].craft_model_to_transformer(
        craft_model=craft, graph=graph, sink=sink, max_seq_len=program.max_seq_len,
        causal=True, compiler_bos=BOS, compiler_pad=PAD)
    return graph, sink, craft, assembled


def _jsonable(value):
    """A RASP value as JSON holds it (bool, int, float, str; anything else as its str)."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (np.integer, np.floating, np.bool_)):
        return value.item()
    return str(value)


# --------------------------------------------------------------------------------------------
# The truth.


def _dirs(space, matrix, axis: int) -> list[str]:
    """Labels of the directions of `space` where `matrix` has a non-zero row (axis 0) or
    column (axis 1)."""
    used = (np.abs(np.asarray(matrix)) > 0).any(axis=1 - axis)
    return [str(d) for d, u in zip(space.basis, used) if u]


def block_names(t, craft) -> list[tuple[int, str]]:
    """(layer, "attn" | "mlp") of each block of the craft model, as tracr's assembler places
    them: each block in the next layer half of its kind (attention, then MLP, per layer)."""
    slots = iter([(layer, kind) for layer in range(len(craft.blocks))
                  for kind in ("attn", "mlp")])
    out = []
    for block in craft.blocks:
        kind = "mlp" if isinstance(block, t["transformers"].MLP) else "attn"
        slot = next(slots)
        while slot[1] != kind:
            slot = next(slots)
        out.append(slot)
    return out


def _components(t, craft) -> list[dict]:
    """Every head and MLP of the compiled model in forward order: its name, layer, the
    directions each of its inputs reads, the directions it writes, and its craft block (a
    head's, or the combined MLP's)."""
    out = []
    for (layer, kind), block in zip(block_names(t, craft), craft.blocks):
        if kind == "mlp":
            out.append({"node": mlp_name(layer), "layer": layer, "block": block,
                        "reads": {"mlp": _dirs(block.fst.input_space, block.fst.matrix, 0)},
                        "writes": _dirs(block.snd.output_space, block.snd.matrix, 1)})
            continue
        for h, head in enumerate(block.as_multi().heads()):
            qk, ov = head.w_qk, head.w_ov
            out.append({"node": head_name(layer, h), "layer": layer, "block": head,
                        "reads": {"q": _dirs(qk.left_space, qk.matrix, 0),
                                  "k": _dirs(qk.right_space, qk.matrix, 1),
                                  "v": _dirs(ov.input_space, ov.matrix, 0)},
                        "writes": _dirs(ov.output_space, ov.matrix, 1)})
    return out


def _upstream(writer: dict, reader: dict, inp: str) -> bool:
    """Whether `writer` (a component, or None for the embedding) comes before `reader`'s
    input `inp` (a head reads what earlier layers wrote; an MLP also its own layer's heads)."""
    if reader is None:  # the logits: after everything
        return True
    if writer["node"].endswith("MLP"):
        return writer["layer"] < reader["layer"]
    return writer["layer"] < reader["layer"] or (inp == "mlp" and
                                                 writer["layer"] == reader["layer"])


def _embedded(label: str) -> bool:
    return label == "one" or label.startswith(("tokens:", "indices:"))


def _token_dependent(comps: list[dict], residual: list[str]) -> dict[str, bool]:
    """Per direction of the residual stream: whether its value changes with the input tokens
    (module docstring): the embedding's token directions but BOS's and the padding's; a
    block's directions when any of its inputs reads one that does (blocks in forward order)."""
    dep = {d: d.startswith("tokens:") and d not in (f"tokens:{BOS}", f"tokens:{PAD}")
           for d in residual if _embedded(d)}
    for c in comps:
        reads = any(dep.get(d, False) for dirs in c["reads"].values() for d in dirs)
        for d in c["writes"]:
            dep[d] = dep.get(d, False) or reads
    return {d: dep.get(d, False) for d in residual}


def variable_of(label: str) -> str:
    """The variable a direction belongs to: `tokens:a` -> tokens, `prev_5:b` -> prev_5."""
    return label.split(":", 1)[0]


def _edges(comps: list[dict], out_dirs: list[str], dep: dict[str, bool]) -> list[dict]:
    """Every edge of the truth (module docstring), in forward order of their readers."""
    readers = [(c, inp, dirs) for c in comps for inp, dirs in c["reads"].items()]
    readers.append((None, "logits", out_dirs))
    edges = []
    for reader, inp, dirs in readers:
        carried: dict[str, list[str]] = {}
        for d in dirs:
            if _embedded(d):
                carried.setdefault("embed", []).append(d)
            for w in comps:
                if w is not reader and d in w["writes"] and _upstream(w, reader, inp):
                    carried.setdefault(w["node"], []).append(d)
        for writer, ds in carried.items():
            edges.append({"from": writer, "to": "logits" if reader is None else reader["node"],
                          "input": inp, "carries": _carries(ds, dep),
                          "tokens": any(dep.get(d, False) for d in ds)})
    return edges


def _carries(dirs: list[str], dep: dict[str, bool]) -> list[dict]:
    """The variables carried on an edge: each with the values it reads (categorical) and
    whether it changes with the tokens."""
    out: dict[str, dict] = {}
    for d in dirs:
        var, _, value = d.partition(":")
        entry = out.setdefault(var, {"variable": var, "values": [], "tokens": False})
        if value:
            entry["values"].append(value)
        entry["tokens"] = entry["tokens"] or dep.get(d, False)
    return list(out.values())


def read_truth(rasp, t, graph, craft, residual: list[str], out_dirs, program: Program) -> dict:
    """The truth of a compiled program (module docstring) as a JSON-able dict."""
    comps = _components(t, craft)
    dep = _token_dependent(comps, residual)
    return {"nodes": _nodes(rasp, t, graph, comps, program),
            "edges": _edges(comps, [str(d) for d in out_dirs], dep),
            "directions": [{"label": d, "variable": variable_of(d), "tokens": dep[d]}
                           for d in residual]}


def _nodes(rasp, t, graph, comps: list[dict], program: Program) -> list[dict]:
    """What each head and MLP computes: the graph's operations placed on the components that
    compile them (a head by its block, an MLP by the directions its operation writes)."""
    N = t["nodes"]
    by_node = {c["node"]: {"node": c["node"], "computes": [], "kind": None} for c in comps}
    for node_id in graph.nodes:
        node = graph.nodes[node_id]
        block = node.get(N.MODEL_BLOCK)
        if block is None:
            continue
        expr = node[N.EXPR]
        parts = block.blocks if isinstance(block, t["transformers"].SeriesWithResiduals) \
            else [block]
        for part in parts:
            for c in _placed(t, part, comps):
                entry = by_node[c["node"]]
                entry["computes"].append(_operation(rasp, expr, node_id))
                if ".H" in c["node"] and hasattr(expr, "selector"):
                    entry["kind"] = entry["kind"] or head_kind(rasp, expr.selector, program)
    return [n for n in by_node.values() if n["computes"]]


def _placed(t, part, comps: list[dict]) -> list[dict]:
    """The components that compile one craft block of a graph node."""
    if isinstance(part, t["transformers"].MLP):
        own = set(_dirs(part.snd.output_space, part.snd.matrix, 1))
        return [c for c in comps if c["node"].endswith("MLP") and own and
                own <= set(c["writes"])]
    heads = list(part.as_multi().heads())
    return [c for c in comps if any(c["block"] is h for h in heads)]


def _operation(rasp, expr, node_id: str) -> dict:
    """One RASP operation: its variable, name, kind of operation, its inputs and, for an
    attention operation, its selector (keys, queries, predicate)."""
    op = {"variable": node_id, "name": expr.name, "op": type(expr).__name__,
          "encoding": "categorical" if rasp.is_categorical(expr) else "numerical",
          "inputs": [c.label for c in expr.children if isinstance(c, rasp.SOp)]}
    sel = getattr(expr, "selector", None)
    if isinstance(sel, rasp.Select):
        pred = sel.predicate
        op["select"] = {"keys": sel.keys.label, "queries": sel.queries.label,
                        "predicate": pred.value if isinstance(pred, rasp.Comparison)
                        else "custom"}
    return op


def head_kind(rasp, select, program: Program) -> str | None:
    """`previous` or `induction` when the selector (causally masked) selects exactly that on
    KIND_INPUTS seeded random inputs of the program's vocabulary; else None."""
    if not isinstance(select, rasp.Select):
        return None
    rng = random.Random(f"head-kind:{program.name}")
    kinds = {"previous", "induction"}
    for _ in range(KIND_INPUTS):
        xs = [rng.choice(program.vocab) for _ in range(rng.randint(1, program.max_seq_len))]
        keys, queries = rasp.evaluate(select.keys, xs), rasp.evaluate(select.queries, xs)
        for q in range(len(xs)):
            chosen = {k for k in range(q + 1) if keys[k] is not None and queries[q] is not None
                      and select.predicate(keys[k], queries[q])}
            if chosen != ({q - 1} if q else set()):
                kinds.discard("previous")
            if chosen != {k for k in range(1, q + 1) if xs[k - 1] == xs[q]}:
                kinds.discard("induction")
        if not kinds:
            return None
    return next(iter(kinds)) if len(kinds) == 1 else None


# --------------------------------------------------------------------------------------------
# The compiled model against tracr's own.


def random_inputs(program: Program, n: int, seed: int, length: int | None = None
                  ) -> list[list[str]]:
    """`n` seeded random inputs of the program's vocabulary, BOS first, each `length` tokens
    after BOS (default: max_seq_len)."""
    rng = random.Random(f"inputs:{program.name}:{seed}")
    length = program.max_seq_len if length is None else length
    return [[BOS] + [rng.choice(program.vocab) for _ in range(length)] for _ in range(n)]


def compare(compiled: Compiled, model, inputs: list[list[str]]) -> dict:
    """tracr's `model.apply` (its batched forward) against the minigpt `model` on `inputs`
    (equal lengths, BOS first): the largest |difference| of the residual stream after every
    half-layer (tracr's residuals after each attention and each MLP; minigpt's as each block's
    MLP reads it and as it leaves the block) and whether every output agrees (past BOS: the
    argmax of a categorical output, the value within 1e-5 of a numerical one)."""
    import torch

    from minigpt.core.gpt import ForwardSpec, Intervention

    class MidBlock(Intervention):  # the stream after each attention layer, as its MLP reads it
        def __init__(self) -> None:
            self.seen: list = []

        def mlp_in(self, layer: int, x):
            self.seen.append(x.numpy().copy())
            return x

    ids = [[compiled.input_ids[t] for t in row] for row in inputs]
    out = compiled.model.forward(compiled.model.params, np.array(ids))
    theirs = [np.asarray(r) for r in out.transformer_output.residuals]
    mid = MidBlock()
    with torch.no_grad():
        x = torch.tensor(ids)
        after = [r.numpy() for r in model.residual_stream(
            x, attn=ForwardSpec(model.cfg.attn_impl, intervention=mid))[1:]]
        logits = model(x)[0].numpy()
    ours = [r for pair in zip(mid.seen, after) for r in pair]  # attn 0, mlp 0, attn 1, ...
    assert len(ours) == len(theirs), (len(ours), len(theirs))
    diff = max(float(np.abs(a - b).max()) for a, b in zip(ours, theirs))
    ref = np.asarray(out.unembedded_output)[:, 1:]
    if compiled.output["kind"] == "categorical":
        same = bool((logits.argmax(-1)[:, 1:] == ref).all())
    else:
        same = bool(np.abs(logits[..., 0][:, 1:] - ref).max() <= 1e-5)
    return {"inputs": len(inputs), "max_residual_diff": diff, "outputs_equal": same}
