"""`minigpt features`: sparse autoencoders on one layer's head outputs.

- Ground truth: on synthetic activations with a known sparse dictionary (more features than
  dimensions), `features train --activations` recovers the dictionary (mean max cosine >= 0.9).
- What the SAE reads is layer L's z in hook_z order, and what it splices back goes where z
  was: an identity splice leaves the loss as it is, a zero splice is the zero-ablation.
- A run's SAE: saved in SAELens's layout, shown (table, JSON, PNG, HTML, one feature),
  beside the heads in inspect-heads; a killed training resumes to the same weights.
- Bad input (shape mismatch, width or k <= 0, k > width, no such layer, an empty text): one
  line, exit 2, nothing written.
- Slow: the installed command's error path; SAELens itself (in its own venv, named by
  MINIGPT_SAELENS_PYTHON) loads the saved SAE and encodes the same activations within 1e-5.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import in_process, make_run, shakespeare

from minigpt.interp.sae import max_cosines
from minigpt.run.safetensors_io import tensors_to_bytes

MINIGPT = shutil.which("minigpt")
SMALL = ["--tokens", "2048", "--held-out", "512", "--steps", "30", "--width", "32", "--k", "4",
         "--batch-size", "256"]


def synthetic(n: int = 20000, d: int = 32, m: int = 64, active: int = 3, seed: int = 0):
    """x (n, d) = sparse codes (n, m) @ dictionary (m, d), unit rows; each feature on with
    chance active / m, magnitude U(0.5, 1.5)."""
    g = torch.Generator().manual_seed(seed)
    dictionary = torch.randn(m, d, generator=g)
    dictionary /= dictionary.norm(dim=1, keepdim=True)
    on = torch.rand(n, m, generator=g) < active / m
    codes = on * (0.5 + torch.rand(n, m, generator=g))
    return codes @ dictionary, dictionary


def test_a_known_dictionary_is_recovered(tmp_path):
    x, dictionary = synthetic()
    acts = tmp_path / "acts.safetensors"
    acts.write_bytes(tensors_to_bytes({"x": x}, {}))
    out = tmp_path / "sae"
    r = in_process(["features", "train", "--activations", acts, "--out", out, "--width", "64",
                    "--k", "4", "--steps", "300", "--batch-size", "256", "--json"])
    assert r.returncode == 0, r.stderr
    w_dec = torch.tensor(json_weights(out)["W_dec"])
    cos = max_cosines(w_dec, dictionary)
    assert float(cos.mean()) >= 0.9, cos
    info = json.loads(r.stdout)
    assert info["quality"]["variance_explained"] > 0.8 and info["quality"]["l0"] <= 4


def json_weights(out: Path) -> dict:
    from minigpt.run.safetensors_io import load_tensors

    return {k: v.tolist() for k, v in load_tensors(out / "sae_weights.safetensors").items()}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    """A tiny run, a text, and an SAE of its layer 1 trained through the command."""
    root = tmp_path_factory.mktemp("features")
    run = make_run(root / "run", top_files=True)
    text = root / "text.txt"
    text.write_text(shakespeare()[:6000])
    out = root / "sae"
    r = in_process(["features", "train", "--run", run, "--layer", "1", "--text-file", text,
                    "--out", out, "--json", *SMALL])
    assert r.returncode == 0, r.stderr
    return {"run": run, "text": text, "sae": out, "info": json.loads(r.stdout),
            "stderr": r.stderr}


def test_the_sae_is_saved_in_saelens_layout(tiny):
    cfg = json.loads((tiny["sae"] / "cfg.json").read_text())
    assert cfg["architecture"] == "topk" and cfg["k"] == 4
    assert (cfg["d_in"], cfg["d_sae"]) == (32, 32)  # 2 heads x 16
    assert cfg["metadata"]["hook_name"] == "blocks.1.attn.hook_z"
    assert cfg["reshape_activations"] == "hook_z" and cfg["apply_b_dec_to_input"]
    w = json_weights(tiny["sae"])
    assert torch.tensor(w["W_enc"]).shape == (32, 32)
    assert torch.allclose(torch.tensor(w["W_dec"]).norm(dim=1), torch.ones(32), atol=1e-5)
    assert not (tiny["sae"] / "train_state.safetensors").exists()
    info = tiny["info"]
    assert info["layer"] == 1 and info["n_head"] == 2
    ce = info["ce"]
    assert ce["recovered"] == pytest.approx(
        (ce["zero_ablated"] - ce["sae"]) / (ce["zero_ablated"] - ce["clean"]))
    assert "loss recovered" in tiny["stderr"]


def test_z_is_read_in_hook_z_order_and_spliced_where_it_was(tiny):
    from minigpt.core.gpt import ForwardSpec, HeadHook
    from minigpt.features import collect
    from minigpt.infer.inputs import load_run_or_model

    loaded = load_run_or_model(tiny["run"], None, "cpu", None)
    rows = torch.randint(256, (3, 17), generator=torch.Generator().manual_seed(1))
    seen = {}

    def keep(layer, z):
        seen[layer] = z.clone()
        return z

    loaded.model(rows[:, :-1], attn=ForwardSpec(intervention=HeadHook(keep)))
    z = collect.collect(loaded.model, rows, 1).view(3, 16, 2, 16)  # [batch, pos, head, d_head]
    assert torch.equal(z, seen[1].transpose(1, 2))
    clean, zero, same = collect.spliced_losses(loaded.model, rows, 1, lambda x: x)
    assert same == clean and zero != clean
    with torch.no_grad():
        zeroed = loaded.model(rows[:, :-1], rows[:, 1:], attn=ForwardSpec(
            head_hook=lambda la, z: torch.zeros_like(z) if la == 1 else z))[1]
    assert zero == pytest.approx(float(zeroed), abs=1e-6)


def test_selectivity_finds_the_token_before_at_or_after_a_firing():
    """On rows whose tokens are known, a feature that fires exactly where the token is 5 is
    selective on `at 5` (share 1), one that fires where the next token is 7 on `next 7`, one
    that fires after a 3 on `prev 3`; one that fires on every token is not selective; one that
    fires fewer than MIN_FIRINGS times has none."""
    from minigpt.features.show import MIN_FIRINGS, SPOTS, selectivity

    g = torch.Generator().manual_seed(0)
    rows = torch.randint(10, 30, (40, 17), generator=g)  # ids 10..29: none of 3, 5, 7 yet
    rows[:, 4], rows[:, 9], rows[:, 12] = 5, 7, 3
    T = rows.shape[1] - 1
    acts = torch.zeros(rows.shape[0] * T, 5)
    at = torch.arange(rows.shape[0] * T)
    pos = at % T
    acts[pos == 4, 0] = 1.0 + torch.rand(int((pos == 4).sum()), generator=g)   # at 5
    acts[pos == 8, 1] = 2.0                                                     # next is 7
    acts[pos == 13, 2] = 0.5                                                    # prev is 3
    acts[:, 3] = 1.0                                                            # everywhere
    acts[:MIN_FIRINGS - 1, 4] = 3.0                                             # rare
    sel = selectivity(acts, rows, n_vocab=32)
    got = [(SPOTS[int(s)], int(t)) for s, t in zip(sel.spot[:3], sel.token[:3])]
    assert got == [("at", 5), ("next", 7), ("prev", 3)]
    assert torch.allclose(sel.share[:3], torch.ones(3))
    assert float(sel.share[3]) < 0.2
    assert torch.isnan(sel.share[4]) and int(sel.firings[4]) == MIN_FIRINGS - 1


def show(tiny, *extra: str):
    r = in_process(["features", "show", "--sae", tiny["sae"], "--text-file", tiny["text"],
                    "--tokens", "1024", *extra])
    assert r.returncode == 0, r.stderr
    return r


def test_show_lists_selective_features_first_and_leaves_out_dense_ones(tiny, tmp_path):
    """The default list: the most selective features first (their share of activation on one
    token), none dense (above --dense) or dead, each with --contexts contexts and its raised /
    lowered tokens among the tokens the text holds; --sort density is the old order; the JSON
    says what was left out. --format json writes the same document, -o where the files go."""
    doc = json.loads(show(tiny, "--json", "--top", "6", "--contexts", "2", "--format",
                          "json,png,html", "-o", tmp_path).stdout)
    feats, shown = doc["features"], doc["shown"]
    keyed = [f["selectivity"] if f["selectivity"] is not None else -1 for f in feats]
    assert keyed == sorted(keyed, reverse=True) and len(feats) == 6
    assert all(0 < f["density"] <= 0.1 and not f["dense"] for f in feats)
    assert all(1 <= len(f["contexts"]) <= 2 for f in feats)
    for f in feats:  # the same place of the text (overlapping rows) shown once
        shown_ctx = [(tuple(c["tokens"]), c["next"]) for c in f["contexts"]]
        assert len(set(shown_ctx)) == len(shown_ctx)
    assert shown["dense"] > 0 and shown["dense_above"] == 0.1 and shown["sort"] == "selectivity"
    from minigpt.data.tokenizer import bytes_tokenizer

    tok = bytes_tokenizer()
    text = tiny["text"].read_text()
    held = set(tok.encode(text[:int(len(text) * 0.9)]))  # the tokens the data holds
    assert shown["unseen_tokens_left_out"] == tok.n_vocab - len(held)
    names = {tok.token_str(i) for i in held}
    assert all(p["token"] in names for f in feats for p in f["promoted"] + f["suppressed"])
    for f in feats:
        assert [h["head"] for h in f["heads"]] == ["L1.H0", "L1.H1"]
        assert sum(h["share"] for h in f["heads"]) == pytest.approx(1, abs=1e-3)
    assert json.loads((tmp_path / "features_shown.json").read_text()) == doc
    page = (tmp_path / "features.html").read_text()
    assert "<h2>Glossary</h2>" in page and "&rarr;" not in page and "dense" in page
    assert (tmp_path / "features.png").read_bytes()[:4] == b"\x89PNG"
    dense = json.loads(show(tiny, "--json", "--sort", "density", "--dense", "1").stdout)
    densities = [f["density"] for f in dense["features"]]
    assert densities == sorted(densities, reverse=True) and densities[0] > 0.1


def test_show_head_lists_the_features_that_head_writes_most(tiny):
    for h in (0, 1):
        doc = json.loads(show(tiny, "--json", "--head", f"L1.H{h}", "--top", "50").stdout)
        assert doc["features"], doc["shown"]
        assert len(doc["features"]) == min(50, doc["shown"]["head_features"])
        for f in doc["features"]:
            shares = [x["share"] for x in f["heads"]]
            assert shares.index(max(shares)) == h
    for bad, needle in (("L0.H0", "reads layer 1's heads"), ("L1.H2", "L1.H0..L1.H1"),
                        ("1.2", "e.g. L1.H2")):
        r = in_process(["features", "show", "--sae", tiny["sae"], "--head", bad])
        assert r.returncode == 2 and "--head" in r.stderr and needle in r.stderr, r.stderr


def test_the_terminal_shows_each_feature_with_its_contexts_marked(tiny):
    r = show(tiny, "--top", "3", "--contexts", "2")
    words = " ".join(r.stdout.split())
    assert "features of the SAE on layer 1's heads, the first 3 by selectivity" in words
    assert r.stdout.count("feature ") >= 3 and "«" in r.stdout and "»" in r.stdout
    assert "of its activation" in r.stdout and "written by L1.H" in r.stdout
    assert "left out:" in words and "dense (active on more than 10% of the tokens" in words
    one = show(tiny, "--feature", "5")
    assert "feature 5 of the SAE on layer 1" in " ".join(one.stdout.split())


def test_show_refuses_bad_numbers_before_torch_loads(tiny):
    for extra, flag in ((["--contexts", "0"], "--contexts"), (["--contexts", "101"], "--contexts"),
                        (["--dense", "0"], "--dense"), (["--dense", "nan"], "--dense"),
                        (["--sort", "heads"], "--sort"), (["--top", "0"], "--top"),
                        (["--seed", "-1"], "--seed"), (["--feature", "-1"], "--feature"),
                        (["--feature", "1", "--head", "L1.H0"], "--feature")):
        r = in_process(["features", "show", "--sae", tiny["sae"], *extra])
        assert r.returncode == 2 and r.stderr.startswith("error: ") and flag in r.stderr, extra
        assert len(r.stderr.strip().splitlines()) == 1


def test_inspect_heads_shows_the_active_features(tiny):
    r = in_process(["inspect-heads", "--run", tiny["run"], "--text", "to be or not to be",
                    "--features", tiny["sae"], "--json"])
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    positions = doc["features"]["positions"]
    assert len(positions) == len(doc["tokens"])
    assert all(0 < len(p) <= 3 and all(x["act"] > 0 for x in p) for p in positions)


def test_a_killed_training_resumes_to_the_same_weights(tiny, tmp_path, monkeypatch):
    from minigpt.events import SaeStep
    from minigpt.features import train_features as build
    from minigpt.features.fit import SaeSettings
    from minigpt.features.train_features import Source, train_features
    from minigpt.infer.inputs import load_run_or_model

    loaded = load_run_or_model(tiny["run"], None, "cpu", None)
    src = Source(loaded, 1, tiny["text"], tokens=2048, held_out=512)
    s = SaeSettings(32, 4, 40, 128, 0, 3)
    whole = train_features(src, s, tmp_path / "whole")

    class Killed(Exception):
        pass

    def kill(e):  # progress comes every 10 steps, before that step's state is saved
        if isinstance(e, SaeStep) and e.step == 30:
            raise Killed

    orig = build.fit_sae
    monkeypatch.setattr(build, "fit_sae", lambda *a, **k: orig(*a, **{**k, "save_every": 10}))
    with pytest.raises(Killed):
        train_features(src, s, tmp_path / "cut", on_event=kill)
    assert (tmp_path / "cut" / "train_state.safetensors").exists()
    assert not (tmp_path / "cut" / "features.json").exists()
    refused = in_process(["features", "train", "--run", tiny["run"], "--layer", "1",
                          "--out", tmp_path / "cut"])
    assert refused.returncode == 2 and "--resume" in refused.stderr
    again = train_features(src, s, tmp_path / "cut", resume=True)
    assert again.resumed_from == 20
    assert json_weights(tmp_path / "cut") == json_weights(tmp_path / "whole")
    assert again.info["quality"] == whole.info["quality"]


class FakeSignal:
    """train.safety.StopFlag as features train uses it, whose flag rises (SIGINT) at the
    `after`-th look: Ctrl-C after a given step, in this process."""

    after = 12

    def __init__(self) -> None:
        self.looks = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    @property
    def signum(self):
        import signal

        self.looks += 1
        return signal.SIGINT if self.looks >= self.after else None


def test_ctrl_c_saves_the_steps_and_says_how_to_resume(tiny, tmp_path, monkeypatch):
    """features train stopped by Ctrl-C after step 12 of 40: exit 130, the state of step 12
    saved (not the last 500-step save), one line naming the step and the command that resumes
    it; that command finishes with the weights of an uninterrupted training (in this process:
    the quick twin of test_the_installed_command_resumes_after_sigint)."""
    import shlex

    from minigpt.train import safety

    base = ["features", "train", "--run", tiny["run"], "--layer", "1", "--text-file",
            tiny["text"], "--tokens", "2048", "--held-out", "512", "--steps", "40",
            "--width", "32", "--k", "4", "--batch-size", "128", "--seed", "3"]
    whole = in_process([*base, "-o", tmp_path / "whole"])
    assert whole.returncode == 0, whole.stderr
    monkeypatch.setattr(safety, "StopFlag", FakeSignal)
    cut = in_process([*base, "-o", tmp_path / "cut"])
    assert cut.returncode == 130, cut.stderr
    assert "interrupted by SIGINT after step 12 of 40" in cut.stderr
    resume = next(line for line in cut.stderr.splitlines() if line.startswith("resume with: "))
    argv = shlex.split(resume.removeprefix("resume with: "))
    assert argv[:3] == ["minigpt", "features", "train"] and argv[-1] == "--resume"
    monkeypatch.undo()
    again = in_process(argv[1:])
    assert again.returncode == 0 and "resumed from step 12" in again.stderr, again.stderr
    assert json_weights(tmp_path / "cut") == json_weights(tmp_path / "whole")


@pytest.mark.slow
def test_the_installed_command_resumes_after_sigint(tiny, tmp_path):
    """A real SIGINT to `minigpt features train` once its first progress line is out."""
    import shlex
    import signal

    base = [MINIGPT, "features", "train", "--run", str(tiny["run"]), "--layer", "1",
            "--text-file", str(tiny["text"]), "--tokens", "2048", "--held-out", "512",
            "--steps", "3000", "--width", "32", "--k", "4", "--batch-size", "64"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([*base, "-o", str(tmp_path / "cut")], stderr=subprocess.PIPE,
                         text=True, env=env, cwd=tmp_path)
    lines = []
    for line in p.stderr:
        lines.append(line)
        if line.startswith("SAE step"):
            p.send_signal(signal.SIGINT)
            break
    rest = p.stderr.read()
    assert p.wait(timeout=300) == 130, "".join(lines) + rest
    stopped = next(x for x in rest.splitlines() if x.startswith("interrupted by SIGINT"))
    step = int(stopped.split("after step ")[1].split()[0])
    assert 0 < step < 3000 and "Traceback" not in rest
    resume = next(x for x in rest.splitlines() if x.startswith("resume with: "))
    argv = shlex.split(resume.removeprefix("resume with: "))
    r = subprocess.run([MINIGPT, *argv[1:]], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=900, check=False)
    assert r.returncode == 0 and f"resumed from step {step}" in r.stderr, r.stderr[-2000:]
    whole = subprocess.run([*base, "-o", str(tmp_path / "whole")], capture_output=True,
                           text=True, env=env, cwd=tmp_path, timeout=900, check=False)
    assert whole.returncode == 0, whole.stderr[-2000:]
    assert json_weights(tmp_path / "cut") == json_weights(tmp_path / "whole")


def test_the_two_dead_fractions_are_named_for_what_they_are(tiny):
    """Training's progress counts the features idle for the last dead_after training tokens
    (AuxK's dead), the end the features never active on the held-out tokens: two numbers,
    two names."""
    assert "idle 0.0% (no firing in 10,000 training tokens)" in tiny["stderr"] or \
        "(no firing in 10,000 training tokens)" in tiny["stderr"]
    assert "features never active on the 512 held-out tokens" in tiny["stderr"]


def test_the_automatic_k_keeps_a_features_mean_density_at_one_token_in_64():
    """--k 0: width / 64, at most 32 (the default run's layers, 1024 wide: 16, as before; the
    induction config's, 512: 8, where 16 made 6.7% of the features dense); an explicit --k is
    kept; the automatic k is what the SAE and its cfg.json get."""
    from minigpt.features.fit import SaeSettings, default_k

    assert [default_k(w) for w in (32, 512, 1024, 6144)] == [1, 8, 16, 32]
    assert SaeSettings(None, 0, 1, 1, 0.0, 0).resolved(64).k == 8
    assert SaeSettings(None, 0, 1, 1, 0.0, 0).resolved(128).k == 16
    assert SaeSettings(None, 5, 1, 1, 0.0, 0).resolved(64).k == 5


def other_shape_run(path: Path) -> Path:
    """A run of another shape (4 heads x 16) than make_run's TINY_MODEL (2 x 16)."""
    from minigpt.config import from_dict
    from minigpt.core.gpt import GPT
    from minigpt.data.tokenizer import bytes_tokenizer
    from minigpt.run.checkpoint import save_checkpoint

    tok = bytes_tokenizer()
    cfg = from_dict({"model": {"n_layer": 2, "n_head": 4, "n_embd": 64, "block_size": 16,
                               "vocab_size": tok.n_vocab}, "tokenizer": {"vocab_size": 256}})
    save_checkpoint(path, step=1, model=GPT.from_config(cfg, seed=0), cfg=cfg, tokenizer=tok,
                    trainer_state={"step": 1})
    return path


@pytest.mark.parametrize("extra, flag", [
    (["--width", "0"], "--width"), (["--k", "-3"], "--k"),
    (["--width", "8", "--k", "9"], "--k"), (["--layer", "2"], "--layer"),
    (["--k", "300"], "--k"),  # beyond the automatic width, 8 x 32
])
def test_bad_settings_are_one_line_and_write_nothing(tiny, tmp_path, extra, flag):
    argv = ["features", "train", "--run", tiny["run"], "--text-file", tiny["text"],
            "--out", tmp_path / "sae", "--layer", "1", "--steps", "5", *extra]
    r = in_process(argv)
    assert r.returncode == 2 and r.stderr.startswith(f"error: {flag}")
    assert len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "sae").exists()


def test_an_empty_text_and_a_mismatched_sae_are_refused(tiny, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    r = in_process(["features", "train", "--run", tiny["run"], "--text-file", empty,
                    "--layer", "0", "--out", tmp_path / "sae"])
    assert r.returncode == 2 and "--text-file" in r.stderr and "0 tokens" in r.stderr
    assert not (tmp_path / "sae").exists()
    other = other_shape_run(tmp_path / "other")
    for argv in (["features", "show", "--sae", tiny["sae"], "--run", other],
                 ["inspect-heads", "--run", other, "--features", tiny["sae"]]):
        r = in_process(argv)
        assert r.returncode == 2 and "does not fit" in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_the_installed_command_refuses_k_above_width(tmp_path):
    x, _ = synthetic(n=200)
    acts = tmp_path / "acts.safetensors"
    acts.write_bytes(tensors_to_bytes({"x": x}, {}))
    r = subprocess.run([MINIGPT, "features", "train", "--activations", str(acts), "--out",
                        str(tmp_path / "sae"), "--width", "16", "--k", "17"],
                       check=False, capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("error: --k: 17 exceeds --width 16")
    assert "Traceback" not in r.stderr and not (tmp_path / "sae").exists()


SAELENS_PYTHON = os.environ.get("MINIGPT_SAELENS_PYTHON")
SAELENS_CHECK = r"""
import sys, torch
from safetensors.torch import load_file
from sae_lens import SAE
sae = SAE.load_from_disk(sys.argv[1], device="cpu")
z = load_file(sys.argv[2])["z"]  # [n, n_head, d_head]: hook_z at each position
acts = sae.encode(z)
recon = sae.decode(acts)
from safetensors.torch import save_file
save_file({"acts": acts.contiguous(), "recon": recon.contiguous()}, sys.argv[3])
print(type(sae).__name__, sae.cfg.metadata.hook_name)
"""


@pytest.mark.slow
@pytest.mark.skipif(not SAELENS_PYTHON, reason="SAELens needs TransformerLens < 4: set "
                    "MINIGPT_SAELENS_PYTHON to the python of a venv with sae-lens installed")
def test_saelens_loads_the_sae_and_encodes_alike(tiny, tmp_path):
    from minigpt.features import collect
    from minigpt.features.store import load_sae
    from minigpt.infer.inputs import load_run_or_model
    from minigpt.run.safetensors_io import load_tensors

    loaded = load_run_or_model(tiny["run"], None, "cpu", None)
    rows = torch.randint(256, (8, 17), generator=torch.Generator().manual_seed(2))
    z = collect.collect(loaded.model, rows, 1)
    (tmp_path / "z.safetensors").write_bytes(tensors_to_bytes({"z": z.view(-1, 2, 16)}, {}))
    script = tmp_path / "check.py"
    script.write_text(SAELENS_CHECK)
    r = subprocess.run([SAELENS_PYTHON, str(script), str(tiny["sae"]),
                        str(tmp_path / "z.safetensors"), str(tmp_path / "out.safetensors")],
                       check=False, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "TopKSAE blocks.1.attn.hook_z" in r.stdout
    theirs = load_tensors(tmp_path / "out.safetensors")
    sae, _, _ = load_sae(tiny["sae"])
    with torch.no_grad():
        ours = sae.encode(z)
        recon = sae.decode(ours)
    torch.testing.assert_close(theirs["acts"], ours, atol=1e-5, rtol=0)
    torch.testing.assert_close(theirs["recon"].reshape(recon.shape), recon, atol=1e-5, rtol=0)


def test_token_text_that_looks_like_markup_is_printed_as_text():
    """Token strings are text, never rich markup: a context ending in `[/]` (a byte-level
    token of the corpus) raised rich's MarkupError in `features show`, and a token `[/b]`
    would have done so in `inspect-heads --features` (found by the slow documented-commands
    run)."""
    from rich.console import Console

    from minigpt.cli.features import features_table
    from minigpt.cli.heads import active_table
    from minigpt.features.show import Feature, FeaturesView

    tricky = ["a", "[/]", "[bold]"]
    view = FeaturesView("sae", 1, 2, {}, [Feature(
        0, 0.5, [0.25, 0.75], contexts=[{"tokens": tricky, "at": 1, "act": 1.0, "next": "x"}],
        promoted=[("[/]", 1.0)], suppressed=[("[/b]", -1.0)])])
    console = Console(width=200, record=True)
    console.print(features_table(view))
    console.print(active_table({"layer": 1, "positions": [[{"feature": 0, "act": 1.0}]] * 3},
                               tricky))
    out = console.export_text()
    assert "[/]" in out and "[bold]" in out and "[/b]" in out


def test_show_reports_collecting_through_the_one_progress_mechanism(tiny):
    """`features show`'s collecting loop sends events.Progress like every long loop: rows done
    of rows, rising to the total."""
    from minigpt.events import Progress
    from minigpt.features.show import describe, load_for
    from minigpt.features.show_options import ShowOptions
    from minigpt.features.store import load_sae
    from minigpt.run import load_run

    loaded = load_run(Path(tiny["run"]), "cpu")
    sae, _ = load_for(Path(tiny["sae"]), loaded)
    _, _, info = load_sae(Path(tiny["sae"]))
    seen = []
    describe(loaded, sae, info, Path(tiny["sae"]),
             ShowOptions(tokens=1024, text_file=Path(tiny["text"])), on_event=seen.append)
    steps = [e for e in seen if isinstance(e, Progress)]
    assert steps and all(e.stage == "z of val" for e in steps)
    assert [e.done for e in steps] == sorted(e.done for e in steps)
    assert steps[-1].done == steps[-1].total
