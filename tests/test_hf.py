"""Hugging Face import (`minigpt.hf.load_model`, `--model`), offline: random-initialised
transformers GPT-2 and GPT-NeoX models saved with `save_pretrained` give the same logits
(1e-4), attention probabilities (1e-5) and greedy continuations in minigpt, also through the
CLI; GPT-2's byte-level BPE gives transformers' ids; inspect inputs start with <|endoftext|>;
refused configs name their field; `hf:` works from huggingface_hub's cache and fails in one
line offline or without the extra; loading maps the weights instead of copying them.

transformers is a test-only dependency (the dev extra); minigpt never imports it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import error_line, perturb, shakespeare
from typer.testing import CliRunner

from minigpt.cli import app
from minigpt.data.tokenizer import EOT
from minigpt.errors import MinigptError
from minigpt.heads.probes import prepare_input
from minigpt.hf import load_model
from minigpt.hf.tokenizer import load_hf_tokenizer

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

# ASCII with contractions and digits, CJK, emoji (skin tone, ZWJ family, flag), combining
# marks (decomposed accents, Devanagari conjunct), whitespace runs and a typed special token.
MIXED = [
    "Hello world! It's a test, isn't it? You'll see: 12345 apples, 3.14159 pies, we've won.",
    "日本語のテキストと中文文本，还有한국어。 Ελληνικά, кириллица.",
    "emoji 😀🎉 thumbs 👍🏽 family 👨‍👩‍👧 flag 🇫🇷 done",
    "combining: e\u0301 a\u0308 n\u0303 A\u030a \u0915\u094d\u0937 ﬁ",
    "   spaces\ttabs\nnewlines\r\n  trailing   \n\n\n x",
    "a <|endoftext|> typed in the text",
]
PROMPT = "ROMEO: 日本語 😀 e\u0301"


def train_bpe(vocab_size: int = 700):
    """A GPT-2-style byte-level BPE trained with the `tokenizers` library, <|endoftext|> last
    (as GPT-2's id 50256)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([shakespeare(), *MIXED * 10], trainer)
    tok.add_special_tokens([EOT])
    return tok


def save_tokenizer(tok, directory: Path, files: str) -> None:
    """files="json": tokenizer.json; "vocab": vocab.json (with <|endoftext|>, as GPT-2's) and
    merges.txt only."""
    directory.mkdir(parents=True, exist_ok=True)
    if files == "json":
        tok.save(str(directory / "tokenizer.json"))
        return
    tok.model.save(str(directory))
    vocab = json.loads((directory / "vocab.json").read_text(encoding="utf-8"))
    vocab[EOT] = tok.token_to_id(EOT)
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")


# name -> (config class, config kwargs, tokenizer files, save_pretrained kwargs)
VARIANTS = {
    "gpt2": ("GPT2Config", {"n_layer": 2, "n_head": 4, "n_embd": 64, "n_positions": 128}, "json",
             {}),
    "gpt2-untied": ("GPT2Config", {"n_layer": 2, "n_head": 4, "n_embd": 64, "n_positions": 128,
                                   "activation_function": "gelu", "layer_norm_epsilon": 1e-3,
                                   "tie_word_embeddings": False}, "vocab",
                    {"max_shard_size": "100KB"}),
    "neox": ("GPTNeoXConfig", {"num_hidden_layers": 2, "num_attention_heads": 4,
                               "hidden_size": 64, "intermediate_size": 256,
                               "max_position_embeddings": 128, "rotary_pct": 1.0,
                               "rotary_emb_base": 500.0, "use_parallel_residual": False,
                               "tie_word_embeddings": False}, "json", {}),
    "neox-tied-nobias": ("GPTNeoXConfig", {"num_hidden_layers": 2, "num_attention_heads": 2,
                                           "hidden_size": 64, "intermediate_size": 256,
                                           "max_position_embeddings": 128, "rotary_pct": 1.0,
                                           "use_parallel_residual": False,
                                           "tie_word_embeddings": True, "attention_bias": False,
                                           "hidden_act": "gelu_new"}, "vocab", {}),
}


@pytest.fixture(scope="module")
def bpe():
    return train_bpe()


@pytest.fixture(scope="module")
def hf_dirs(bpe, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    eot, vocab = bpe.token_to_id(EOT), bpe.get_vocab_size()
    out = {}
    for i, (name, (cls, kw, files, save_kw)) in enumerate(VARIANTS.items()):
        config = getattr(transformers, cls)(vocab_size=vocab, bos_token_id=eot,
                                            eos_token_id=eot, **kw)
        model_cls = (transformers.GPT2LMHeadModel if cls == "GPT2Config"
                     else transformers.GPTNeoXForCausalLM)
        torch.manual_seed(i)
        model = model_cls(config)
        perturb(model, i)
        model.save_pretrained(root / name, **save_kw)
        save_tokenizer(bpe, root / name, files)
        out[name] = root / name
    assert (out["gpt2-untied"] / "model.safetensors.index.json").is_file()  # sharded
    return out


def reference(directory: Path):
    """The model as transformers loads it, with eager attention (it returns probabilities)."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        directory, attn_implementation="eager").eval()


def reference_tokenizer(directory: Path):
    """The tokenizer files as transformers reads them, without a model-specific class on top
    (transformers 5's GPTNeoXTokenizer adds Pythia's NFC normalizer, which these files lack)."""
    if (directory / "tokenizer.json").is_file():
        return transformers.PreTrainedTokenizerFast(
            tokenizer_file=str(directory / "tokenizer.json"))
    return transformers.GPT2Tokenizer.from_pretrained(directory)


def ids_of(n: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------------------------
# The model.


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_logits_and_attention_equal_transformers(hf_dirs, name):
    ours = load_model(hf_dirs[name], "cpu")
    ref = reference(hf_dirs[name])
    idx = ids_of(100, ours.cfg.model.vocab_size, seed=1)
    with torch.no_grad():
        want = ref(idx, output_attentions=True)
        sdpa, _ = ours.model(idx)
        explicit, probs = ours.model.forward_with_attention(idx)
    assert (sdpa - want.logits).abs().max() <= 1e-4
    assert (explicit - want.logits).abs().max() <= 1e-4
    assert len(probs) == len(want.attentions)
    for a, b in zip(probs, want.attentions):
        assert a.shape == b.shape and (a - b).abs().max() <= 1e-5
    assert ours.run_dir is None and ours.step == 0 and ours.eot_first


def test_gpt2_weights_are_views_of_the_file_and_the_head_stays_tied(hf_dirs):
    """No copy: Conv1D weights become transposed views; the tied head is the embedding."""
    m = load_model(hf_dirs["gpt2"], "cpu").model
    w = m.blocks[0].attn.c_attn.weight
    assert w.shape == (192, 64) and not w.is_contiguous() and w.t().is_contiguous()
    assert m.lm_head.weight is m.wte.weight
    assert m.num_params()["lm_head"] == 0


@pytest.mark.parametrize("name", ["gpt2", "neox"])
def test_greedy_50_tokens_through_the_cli_equal_transformers(hf_dirs, name):
    ref_tok = reference_tokenizer(hf_dirs[name])
    ref = reference(hf_dirs[name])
    prompt_ids = ref_tok.encode(PROMPT)
    eot = ref_tok.convert_tokens_to_ids(EOT)
    with torch.no_grad():
        gen = ref.generate(torch.tensor([prompt_ids]), max_new_tokens=50, do_sample=False,
                           eos_token_id=eot, pad_token_id=eot)[0, len(prompt_ids):].tolist()
    r = CliRunner().invoke(app, ["sample", "--model", str(hf_dirs[name]), "-p", PROMPT,
                                 "-n", "50", "-t", "0", "--json"])
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["prompt_tokens"] == len(prompt_ids)
    assert doc["tokens"] == len(gen)
    assert doc["finish_reason"] == ("eot" if gen[-1] == eot else "length")
    text = ref_tok.decode([t for t in gen if t != eot], clean_up_tokenization_spaces=False)
    assert doc["text"] == text


@pytest.mark.parametrize("name", ["gpt2-untied", "neox-tied-nobias"])
def test_inspect_heads_safetensors_equal_output_attentions(hf_dirs, name, tmp_path):
    from safetensors import safe_open

    r = CliRunner().invoke(app, ["inspect-heads", "--model", str(hf_dirs[name]), "--text",
                                 MIXED[0], "--format", "safetensors", "--out", str(tmp_path)])
    assert r.exit_code == 0, r.stderr
    with safe_open(str(tmp_path / "attention.safetensors"), "pt") as fh:
        attn, tokens = fh.get_tensor("attention"), fh.get_tensor("tokens")
    with torch.no_grad():
        want = reference(hf_dirs[name])(tokens[None], output_attentions=True).attentions
    assert attn.shape == (len(want), want[0].shape[1], len(tokens), len(tokens))
    assert (attn - torch.stack([a[0] for a in want])).abs().max() <= 1e-5
    assert "explicit vs SDPA" in r.stderr and "ok" in r.stderr


# --------------------------------------------------------------------------------------------
# The tokenizer.


TOKENIZER_ROWS = 1024  # the embedding rows a model would give: more than the BPE's 701 ids


@pytest.fixture(scope="module")
def tokenizer_dirs(bpe, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tok")
    for files in ("json", "vocab"):
        save_tokenizer(bpe, root / files, files)
    return {"json": root / "json", "vocab": root / "vocab"}


def test_ids_equal_transformers_gpt2_tokenizer(tokenizer_dirs):
    """GPT2Tokenizer (from vocab.json + merges.txt) is the reference; minigpt reads either
    file set. <|endoftext|> is kept out of the comparison: transformers reads it as the special
    token, minigpt as text (next test)."""
    ref = transformers.GPT2Tokenizer.from_pretrained(tokenizer_dirs["vocab"])
    ours = {k: load_hf_tokenizer(d, k, TOKENIZER_ROWS) for k, d in tokenizer_dirs.items()}
    texts = [t.replace(EOT, "<|end of text|>") for t in MIXED]
    texts += shakespeare()[-20_000:].split("\n\n") + ["".join(MIXED[:5]) * 3, ""]
    for text in texts:
        want = ref.encode(text)
        for tok in ours.values():
            assert tok.encode(text) == want, text
            assert tok.decode(want) == text
    assert ours["json"].ranks == ours["vocab"].ranks
    assert ours["json"].eot_id == ours["vocab"].eot_id == ref.convert_tokens_to_ids(EOT)


def test_endoftext_typed_is_text_unless_allowed(tokenizer_dirs):
    tok = load_hf_tokenizer(tokenizer_dirs["json"], "t", TOKENIZER_ROWS)
    assert tok.eot_id not in tok.encode(MIXED[-1])
    assert tok.encode(MIXED[-1], allow_special=True).count(tok.eot_id) == 1


def swap_last_two_merge_ids(model: dict) -> None:
    """The tokens of the last two merges trade ids: the ids no longer follow the merges."""
    a, b = ("".join(m.split(" ") if isinstance(m, str) else m) for m in model["merges"][-2:])
    vocab = model["vocab"]
    vocab[a], vocab[b] = vocab[b], vocab[a]


@pytest.mark.parametrize("edit, needle", [
    (lambda d: d["model"].update(type="WordPiece"), "model type 'WordPiece'"),
    (lambda d: d.update(normalizer={"type": "NFC"}), "normalizer"),
    (lambda d: d["pre_tokenizer"].update(add_prefix_space=True), "add_prefix_space"),
    (lambda d: d.update(pre_tokenizer={"type": "Whitespace"}), "'Whitespace'"),
    (lambda d: d["model"]["vocab"].pop("Ġ"), "byte 0x20"),
    (lambda d: swap_last_two_merge_ids(d["model"]), "merge order"),
])
def test_tokenizer_files_minigpt_cannot_run_exactly_are_refused(tokenizer_dirs, tmp_path, edit,
                                                                 needle):
    d = json.loads((tokenizer_dirs["json"] / "tokenizer.json").read_text(encoding="utf-8"))
    edit(d)
    (tmp_path / "tokenizer.json").write_text(json.dumps(d), encoding="utf-8")
    with pytest.raises(MinigptError, match="tokenizer.json") as e:
        load_hf_tokenizer(tmp_path, "t", TOKENIZER_ROWS)
    assert needle in str(e.value)


# --------------------------------------------------------------------------------------------
# Inspection input.


def test_inspect_input_of_a_pretrained_model_starts_with_endoftext(hf_dirs):
    r = CliRunner().invoke(app, ["inspect-heads", "--model", str(hf_dirs["gpt2"]), "--probe",
                                 "induction", "--max-tokens", "21", "--json"])
    assert r.exit_code == 0, r.stderr
    tokens = json.loads(r.stdout)["tokens"]
    loaded = load_model(hf_dirs["gpt2"])
    assert len(tokens) == 21 and tokens[0] == loaded.tokenizer.eot_id
    assert tokens[1:11] == tokens[11:] and loaded.tokenizer.eot_id not in tokens[1:]
    text = prepare_input(loaded.cfg, loaded.tokenizer, text="Hi there", eot_first=True)
    assert text.tokens == [loaded.tokenizer.eot_id, *loaded.tokenizer.encode("Hi there")]
    plain = prepare_input(loaded.cfg, loaded.tokenizer, probe="induction", max_tokens=20)
    assert plain.tokens[:10] == plain.tokens[10:]  # a minigpt run: no <|endoftext|> first


def test_ablation_of_a_gpt2_model_scores_the_copy_after_endoftext(hf_dirs):
    """--ablate on a GPT-2 directory: every head gets an effect, scored on the 9 predictions
    inside the probe's second copy (the input is <|endoftext|> + 10 ids + the same 10), equal to
    the library's."""
    from minigpt.interp.heads import ablate_heads

    r = CliRunner().invoke(app, ["inspect-heads", "--model", str(hf_dirs["gpt2"]), "--probe",
                                 "induction", "--max-tokens", "21", "--ablate", "mean",
                                 "--json"])
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    loaded = load_model(hf_dirs["gpt2"])
    want = ablate_heads(loaded.model, doc["tokens"], "mean", positions=list(range(11, 20)))
    assert doc["ablation"]["n_scored"] == 9 and doc["ablation"]["mode"] == "mean"
    assert doc["ablation"]["base_loss"] == pytest.approx(want.base_loss, abs=1e-5)
    got = {(row["layer"], row["index"]): row["ablation"] for row in doc["heads"]}
    assert len(got) == loaded.cfg.model.n_layer * loaded.cfg.model.n_head
    for (layer, head), v in got.items():
        assert v == pytest.approx(float(want.effect[layer, head]), abs=1e-5)


# --------------------------------------------------------------------------------------------
# Configs minigpt does not implement: refused, naming the field.


@pytest.mark.parametrize("name, change, needle", [
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ("gpt2", {"reorder_and_upcast_attn": True}, "reorder_and_upcast_attn"),
    ("gpt2", {"n_inner": 100}, "n_inner"),
    ("gpt2", {"activation_function": "relu"}, "activation_function"),
    ("gpt2", {"add_cross_attention": True}, "add_cross_attention"),
    ("gpt2", {"architectures": ["GPT2ForSequenceClassification"]}, "architectures"),
    ("gpt2", {"n_head": 5}, "n_head"),
    ("gpt2", {"n_layer": 0}, "n_layer"),
    ("neox", {"use_parallel_residual": True}, "use_parallel_residual"),
    ("neox", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                  "partial_rotary_factor": 0.25}}, "partial_rotary_factor"),
    ("neox", {"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_type"),
    ("neox", {"intermediate_size": 100}, "intermediate_size"),
    ("neox", {"model_type": "llama"}, "model_type"),
])
def test_unsupported_config_options_are_refused_by_name(hf_dirs, tmp_path, name, change,
                                                        needle):
    d = tmp_path / name
    shutil.copytree(hf_dirs[name], d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(MinigptError, match="config.json") as e:
        load_model(d)
    assert needle in str(e.value) and "\n" not in str(e.value)


# --------------------------------------------------------------------------------------------
# hf:REPO_ID through huggingface_hub: in this process (its settings patched) and, [slow], in
# real processes configured the way a user does it (environment variables).


def cache_snapshot(src: Path, hub_cache: Path, repo: str) -> None:
    """`src` laid out as huggingface_hub caches a download: refs/main -> snapshots/<commit>."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    d = hub_cache / ("models--" + repo.replace("/", "--"))
    shutil.copytree(src, d / "snapshots" / commit)
    (d / "refs").mkdir()
    (d / "refs" / "main").write_text(commit)


@pytest.fixture
def offline_hub(tmp_path, monkeypatch) -> Path:
    """huggingface_hub offline, its cache an empty directory under tmp."""
    constants = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


def test_hub_model_offline_from_the_cache_and_not_cached(hf_dirs, offline_hub):
    cache_snapshot(hf_dirs["neox"], offline_hub, "someone/tiny-neox")
    hub = load_model("hf:someone/tiny-neox@main")
    local = load_model(hf_dirs["neox"])
    idx = ids_of(20, local.cfg.model.vocab_size, seed=3)
    assert torch.equal(hub.model(idx)[0], local.model(idx)[0])
    assert hub.source == "hf:someone/tiny-neox@main"
    assert hub.cfg.run.name == "someone/tiny-neox@main"
    r = CliRunner().invoke(app, ["sample", "--model", "hf:someone/not-cached"])
    assert r.exit_code == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("error: --model hf:someone/not-cached: download failed")
    # the whole sentence: what happened and the fix, never a message cut mid-sentence
    assert "HF_HUB_OFFLINE is set" in r.stderr
    assert r.stderr.rstrip().endswith("or give a local model directory"), r.stderr


def test_hub_without_the_extra_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # `import` raises ImportError
    r = CliRunner().invoke(app, ["inspect-heads", "--model", "hf:gpt2"])
    assert r.exit_code == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "pip install 'minigpt-lab[hf]'" in r.stderr


def test_download_failures_are_one_line_and_bugs_keep_their_traceback(monkeypatch):
    """Only what a download raises when it cannot be made (OSError and the hub's own errors)
    becomes "download failed"; a TypeError inside the call is a bug, raised as it is."""
    hub = pytest.importorskip("huggingface_hub")
    from huggingface_hub.errors import LocalEntryNotFoundError

    from minigpt.errors import ArgumentError

    def raises(e):
        def snapshot_download(*a, **k):
            raise e
        return snapshot_download

    for error in (LocalEntryNotFoundError("offline and not cached"),
                  OSError("No space left on device")):
        monkeypatch.setattr(hub, "snapshot_download", raises(error))
        with pytest.raises(ArgumentError, match="download failed"):
            load_model("hf:someone/tiny")
    monkeypatch.setattr(hub, "snapshot_download", raises(TypeError("a bug")))
    with pytest.raises(TypeError, match="a bug"):
        load_model("hf:someone/tiny")


def minigpt_process(args: list[str], tmp_path: Path, **env: str):
    return subprocess.run([sys.executable, "-m", "minigpt", *args], check=False,
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "HF_HOME": str(tmp_path / "hf-home"),
                               "MINIGPT_CACHE": str(tmp_path / "cache"), **env})


@pytest.mark.slow
def test_hub_process_from_the_cache_offline_equals_the_local_directory(hf_dirs, tmp_path):
    cache_snapshot(hf_dirs["gpt2"], tmp_path / "hf-home" / "hub", "someone/tiny-gpt2")
    args = ["sample", "-p", PROMPT, "-n", "12", "-t", "0", "--json"]
    hub = minigpt_process([*args, "--model", "hf:someone/tiny-gpt2"], tmp_path,
                          HF_HUB_OFFLINE="1")
    local = minigpt_process([*args, "--model", str(hf_dirs["gpt2"])], tmp_path)
    assert hub.returncode == 0, hub.stderr
    assert json.loads(hub.stdout)["text"] == json.loads(local.stdout)["text"]
    assert "hf:someone/tiny-gpt2" in hub.stderr


@pytest.mark.slow
def test_hub_process_offline_without_the_model_is_one_line(tmp_path):
    r = minigpt_process(["sample", "--model", "hf:someone/not-cached@v1"], tmp_path,
                        HF_HUB_OFFLINE="1")
    line = error_line(r)
    assert "--model hf:someone/not-cached@v1" in line and "download failed" in line


@pytest.mark.slow
def test_hub_process_without_the_extra_says_what_to_install(tmp_path):
    fake = tmp_path / "no-hub" / "huggingface_hub"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('simulated: not installed')\n")
    path = os.pathsep.join([str(fake.parent), os.environ.get("PYTHONPATH", "")])
    r = minigpt_process(["inspect-heads", "--model", "hf:gpt2"], tmp_path, PYTHONPATH=path)
    assert "pip install 'minigpt-lab[hf]'" in error_line(r)


# --------------------------------------------------------------------------------------------
# bench and the real command.


def test_bench_sample_suite_decodes_the_model(hf_dirs):
    r = CliRunner().invoke(app, ["bench", "--suite", "sample", "--quick", "--model",
                                 str(hf_dirs["neox"])])
    assert r.exit_code == 0, r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["suites"] == ["sample"] and summary["sample"]["decode_tokens_per_s"] > 0
    assert str(hf_dirs["neox"]) in r.stdout and "identical" in r.stdout


@pytest.mark.slow
def test_greedy_through_the_installed_command_equals_transformers(hf_dirs, tmp_path):
    name = "gpt2-untied"
    ref_tok = reference_tokenizer(hf_dirs[name])
    prompt_ids = ref_tok.encode(PROMPT)
    with torch.no_grad():
        gen = reference(hf_dirs[name]).generate(
            torch.tensor([prompt_ids]), max_new_tokens=50, do_sample=False,
            eos_token_id=ref_tok.convert_tokens_to_ids(EOT),
            pad_token_id=ref_tok.convert_tokens_to_ids(EOT))[0, len(prompt_ids):].tolist()
    r = subprocess.run(["minigpt", "sample", "--model", str(hf_dirs[name]), "-p", PROMPT, "-n",
                        "50", "-t", "0", "--json"], check=False, capture_output=True,
                       text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["tokens"] == len(gen)
    assert doc["text"] == ref_tok.decode([t for t in gen if t != ref_tok.eos_token_id],
                                         clean_up_tokenization_spaces=False)


# --------------------------------------------------------------------------------------------
# Memory: the weights are mapped from the file, never held twice.

RSS_PROBE = r"""
import json, sys, torch
from minigpt.hf import load_model
def status(key):
    return next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith(key))
before = status('VmRSS:')
m = load_model(sys.argv[1]).model
with torch.inference_mode():
    m(torch.arange(8)[None])  # every weight read: the blocks, and the tied head reads all of wte
print(json.dumps({'grew': status('VmHWM:') - before}))
"""


@pytest.mark.slow
def test_loading_maps_the_weights_instead_of_copying_them(tmp_path):
    """A GPT-2-shaped checkpoint (vocab 50257, 6 x 512: 180 MB) written with safetensors
    directly: after loading and a forward pass that reads every weight, the process grew by
    about one copy of the file (its pages), not two."""
    from safetensors.torch import save_file

    from minigpt.data.tokenizer import bytes_tokenizer
    from minigpt.hf.tokenizer import tokenizer_json

    n_layer, C, V = 6, 512, 50257
    gen = torch.Generator().manual_seed(0)
    tensors = {"wte.weight": torch.randn(V, C, generator=gen) * 0.02,
               "wpe.weight": torch.randn(1024, C, generator=gen) * 0.02,
               "ln_f.weight": torch.ones(C), "ln_f.bias": torch.zeros(C)}
    for i in range(n_layer):
        for ln in ("ln_1", "ln_2"):
            tensors[f"h.{i}.{ln}.weight"] = torch.ones(C)
            tensors[f"h.{i}.{ln}.bias"] = torch.zeros(C)
        for name, (n_in, n_out) in (("attn.c_attn", (C, 3 * C)), ("attn.c_proj", (C, C)),
                                    ("mlp.c_fc", (C, 4 * C)), ("mlp.c_proj", (4 * C, C))):
            tensors[f"h.{i}.{name}.weight"] = torch.randn(n_in, n_out, generator=gen) * 0.02
            tensors[f"h.{i}.{name}.bias"] = torch.zeros(n_out)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    nbytes = sum(t.numel() * 4 for t in tensors.values())
    del tensors
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "gpt2", "n_layer": n_layer, "n_embd": C, "n_head": 8, "vocab_size": V,
        "n_positions": 1024}))
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer_json(bytes_tokenizer())))
    r = subprocess.run([sys.executable, "-c", RSS_PROBE, str(tmp_path)], capture_output=True,
                       text=True, timeout=300, check=True)
    grew = json.loads(r.stdout)["grew"]
    assert 0.8 * nbytes < grew < 1.3 * nbytes, (grew / 2**20, nbytes / 2**20)
