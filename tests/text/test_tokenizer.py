"""Tokenizers built from GGUF metadata against transformers' and llama.cpp's readings."""

import pytest

from tests.loading.gguf_models import GEMMA, MODELS, gguf_path, hf_tokenizer, llama_cpp_detokenize, llama_cpp_vocab
from xinfer.text.detokenizer import IncrementalDetokenizer
from xinfer.text.tokenizer import Tokenizer

MIXED = (
    "Hello world!  Café naïve résumé — déjà vu, Ångström. 東京は晴れ、北京欢迎你 한국어 "
    "🌞🚀👩‍💻 def f(x):\n    return x**2  # 12345\n\n\tTabs   and    spaces 3.14159 "
    "l'été, don't I'll \u00a0nbsp 𝔘𠀋 (rare: byte fallback)   \n"
)
TEXTS = [MIXED, "plain english text", "  leading spaces", "trailing spaces   ", "数字123数字", "a\n\n\nb"]
# where transformers' reading of the GGUF file differs, llama.cpp's (the file format's own runtime) is the reference
LLAMA_CPP_TEXTS = [
    " \x06<",  # SmolLM2 lacks the byte 0x06: dropped, but no merge joins its neighbours
    "a</s>b",  # Gemma 3's </s>: user-defined in the file, an end-of-generation control token to llama.cpp
    "x" + " " * 20 + "12",  # SmolLM2 splits the digits off first: the spaces stay one run
]


@pytest.fixture(scope="module", params=MODELS)
def model(request):
    return request.param


@pytest.fixture(scope="module")
def ours(model):
    return Tokenizer.from_gguf(gguf_path(model))


@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_transformers(model, ours, text):
    reference = hf_tokenizer(model)
    assert ours.encode(text) == reference.encode(text)
    assert ours.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS + LLAMA_CPP_TEXTS)
def test_ids_match_llama_cpp(model, ours, text):
    vocab = llama_cpp_vocab(model)
    assert ours.encode(text) == vocab.tokenize(text.encode(), add_bos=True, special=True)
    assert ours.encode(text, add_special_tokens=False) == vocab.tokenize(text.encode(), add_bos=False, special=True)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("text", [MIXED, *LLAMA_CPP_TEXTS])
def test_decode_matches_llama_cpp(model, ours, text, skip_special_tokens):
    ids = ours.encode(f"{text}{ours.eos_token}")
    expected = llama_cpp_detokenize(model, ids, special=not skip_special_tokens).decode()
    assert ours.decode(ids, skip_special_tokens=skip_special_tokens) == expected


def test_a_cut_character_decodes_as_llama_cpps_bytes(model, ours):
    """A run of byte tokens that starts inside a character: each stray byte is one U+FFFD, the whole character after
    them is kept (tokenizers' ByteFallback decoder made the whole run U+FFFD), and the stream gives the same."""
    ids = ours.encode("𓀀𓀀", add_special_tokens=False)[1:]
    expected = llama_cpp_detokenize(model, ids, special=False).decode(errors="replace")
    assert expected.endswith("𓀀")
    assert ours.decode(ids) == expected
    stream = IncrementalDetokenizer(ours)
    assert "".join(stream.push(i) for i in ids) + stream.flush() == expected


def test_special_tokens_match_transformers(model, ours):
    reference = hf_tokenizer(model)
    assert ours.bos_token == reference.bos_token
    assert ours.eos_token == reference.eos_token
    assert ours.bos_token_id == reference.bos_token_id
    assert reference.eos_token_id in ours.eos_token_ids
    assert ours.vocab_size == len(reference)
    # a special token written in the text is one token, as in a rendered chat prompt
    text = f"{reference.eos_token}x"
    assert ours.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_inverts_encode(ours, text):
    assert ours.decode(ours.encode(text)) == text


def test_token_bytes_join_to_the_texts_utf8(ours):
    """Each token's bytes, those of a part of a character too (byte-level BPE's and byte-fallback pieces)."""
    ids = ours.encode(MIXED, add_special_tokens=False)
    assert any("\ufffd" in ours.decode([i]) for i in ids), "no token holds a part of a character"
    assert b"".join(ours.token_bytes(i) for i in ids) == MIXED.encode()


def test_decode_matches_transformers(model, ours):
    reference = hf_tokenizer(model)
    ids = ours.encode(MIXED)
    assert ours.decode(ids, skip_special_tokens=False) == reference.decode(ids, skip_special_tokens=False)
    assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_streamed_deltas_concatenate_to_decode(ours, skip_special_tokens):
    ids = ours.encode(MIXED + ours.eos_token + " after eos")
    stream = IncrementalDetokenizer(ours, skip_special_tokens=skip_special_tokens)
    deltas = [stream.push(i) for i in ids]
    text = "".join(deltas) + stream.flush()
    assert text == ours.decode(ids, skip_special_tokens=skip_special_tokens)
    assert not any("\ufffd" in d for d in deltas), "a delta split a UTF-8 character"


def test_stream_continues_a_prompt(ours):
    ids = ours.encode(MIXED)
    prompt, generated = ids[:7], ids[7:]
    stream = IncrementalDetokenizer(ours, prompt_ids=prompt)
    text = "".join(stream.push(i) for i in generated) + stream.flush()
    assert ours.decode(prompt) + text == ours.decode(ids)


def test_stream_continues_a_prompt_cut_inside_a_character(ours):
    prompt = ours.encode("ok 𓀀", add_special_tokens=False)[:-1]  # the character's last byte is missing
    assert ours.decode(prompt).endswith("\ufffd")
    generated = ours.encode(" and on", add_special_tokens=False)
    stream = IncrementalDetokenizer(ours, prompt_ids=prompt)
    text = "".join(stream.push(i) for i in generated) + stream.flush()
    assert ours.decode(prompt) + text == ours.decode(prompt + generated)


def test_stream_decodes_a_bounded_window(ours):
    windows = []

    class Recording:
        def decode(self, ids, skip_special_tokens=True):
            windows.append(len(ids))
            return ours.decode(ids, skip_special_tokens)

    ids = ours.encode(MIXED * 8)
    stream = IncrementalDetokenizer(Recording())
    for i in ids:
        stream.push(i)
    assert len(ids) > 200 and max(windows) <= 8, f"decoded windows up to {max(windows)} ids"


@pytest.mark.parametrize("add_bos_token", [None, True, False])
def test_folder_tokenizer_matches_transformers(tmp_path, add_bos_token):
    import json

    from transformers import AutoTokenizer, GenerationConfig

    hf_tokenizer("smollm2").save_pretrained(tmp_path)
    config_file = tmp_path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.pop("add_bos_token", None)
    if add_bos_token is not None:
        config["add_bos_token"] = add_bos_token
    config_file.write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    reference, ours = AutoTokenizer.from_pretrained(tmp_path), Tokenizer.from_folder(tmp_path)
    assert ours.encode(MIXED) == reference.encode(MIXED)
    assert ours.decode(ours.encode(MIXED)) == reference.decode(reference.encode(MIXED), skip_special_tokens=True)
    assert (ours.bos_token_id, ours.eos_token) == (reference.bos_token_id, reference.eos_token)
    assert ours.eos_token_ids == set(GenerationConfig.from_pretrained(tmp_path).eos_token_id)


def test_eos_ids_are_end_of_generation_for_llama_cpp(model, ours):
    vocab = llama_cpp_vocab(model)._model.vocab  # skips when llama.cpp is absent
    import llama_cpp

    end_of_generation = {i for i in range(ours.vocab_size) if llama_cpp.llama_vocab_is_eog(vocab, i)}
    # besides EOS: SmolLM2's <|im_end|> and <reponame> (fill-in-the-middle), Gemma's <end_of_turn> and </s>
    assert len(end_of_generation) > 2
    assert ours.eos_token_ids == end_of_generation


# vocabularies whose end-of-generation tokens llama.cpp finds by their spelling or metadata id
END_OF_GENERATION_VOCABULARIES = {
    "harmony": (["<|end|>", "<|return|>", "<|call|>", "<|start|>", "</s>"], {"eos": 4}),  # <|end|> ends a message only
    "tool-response": (
        ["</s>", "<|tool_response>", "<eos>", "<|fim_pad|>", "<|file_sep|>", "<|repo_name|>"],
        {"eos": 5},
    ),
    "declared": (["<x>", "<y>", "<z>", "<|im_end|>"], {"eos": 3, "eot": 4, "fim_rep": 5}),
}


@pytest.mark.parametrize("vocabulary", sorted(END_OF_GENERATION_VOCABULARIES))
def test_end_of_generation_tokens_are_llama_cpps(tmp_path, vocabulary):
    import gguf

    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (optional oracle)")
    words, ids = END_OF_GENERATION_VOCABULARIES[vocabulary]
    tokens = ["a", "b", "ab", *words]
    writer = gguf.GGUFWriter(tmp_path / "vocab.gguf", "llama")
    writer.add_block_count(1)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    writer.add_token_merges(["a b"])
    for key, token_id in ids.items():
        writer.add_uint32(f"tokenizer.ggml.{key}_token_id", token_id)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reference = llama_cpp.Llama(model_path=str(tmp_path / "vocab.gguf"), vocab_only=True, verbose=False)
    expected = {i for i in range(len(tokens)) if llama_cpp.llama_vocab_is_eog(reference._model.vocab, i)}
    assert Tokenizer.from_gguf(tmp_path / "vocab.gguf").eos_token_ids == expected


def test_a_trailing_incomplete_character_is_flushed_as_decode_gives_it(ours):
    """The stream holds back a character's first bytes; at the end, ``flush`` gives what decode gives them."""
    ids = ours.encode("ok 𓀀")  # four bytes, byte-fallback tokens in both vocabularies
    partial = next(n for n in range(len(ids), 0, -1) if ours.decode(ids[:n]).endswith("\ufffd"))
    stream = IncrementalDetokenizer(ours)
    text = "".join(stream.push(i) for i in ids[:partial])
    assert "\ufffd" not in text
    assert text + stream.flush() == ours.decode(ids[:partial])


SPACE_PREFIX_TEXTS = [" Hello", "Hello  world", "<start_of_turn>user\nhi<end_of_turn>", "<bos>x", "a\tb", "\n\nx y"]


@pytest.fixture(scope="module")
def space_prefixed_vocabulary(tmp_path_factory):
    """Gemma 3's SentencePiece vocabulary with ``add_space_prefix`` on, as Llama 2 and Mistral files have it (and
    as llama.cpp reads a file without the key)."""
    import gguf

    from xinfer.loading.gguf_file import GGUFFile

    meta = GGUFFile(gguf_path(GEMMA)).metadata
    path = tmp_path_factory.mktemp("spm") / "vocab.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(list(meta["tokenizer.ggml.tokens"]))
    writer.add_token_types([int(t) for t in meta["tokenizer.ggml.token_type"]])
    writer.add_token_scores([float(s) for s in meta["tokenizer.ggml.scores"]])
    for key in ("bos", "eos", "unknown", "padding"):
        writer.add_uint32(f"tokenizer.ggml.{key}_token_id", int(meta[f"tokenizer.ggml.{key}_token_id"]))
    writer.add_add_bos_token(False)
    writer.add_add_space_prefix(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("text", SPACE_PREFIX_TEXTS)
def test_a_space_prefix_starts_every_piece_of_text_as_llama_cpps(space_prefixed_vocabulary, text):
    """llama.cpp prefixes the space to the text's first piece even where it starts with a space, and to each
    piece after a special or user-defined token."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (optional oracle)")
    reference = llama_cpp.Llama(model_path=str(space_prefixed_vocabulary), vocab_only=True, verbose=False)
    expected = reference.tokenize(text.encode(), add_bos=False, special=True)
    assert Tokenizer.from_gguf(space_prefixed_vocabulary).encode(text) == expected


def test_token_bytes_keep_a_sentencepiece_words_leading_space(tmp_path):
    """Decoded alone, a Llama-2-style tokenizer strips the space ``▁`` stands for (transformers' decode([id]) gives
    "Hello"), which left a logprob's ``bytes`` short of the text's, and the byte piece ``<0x20>`` empty; llama.cpp's
    pieces are " Hello" and " "."""
    import json

    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<0x20>": 3, "▁Hello": 4, "▁": 5, "world": 6, "<0x0A>": 7}
    backend = Backend(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    ours = Tokenizer.from_folder(tmp_path)
    assert ours.decode([4]) == "Hello"  # as transformers decodes it alone
    assert [ours.token_bytes(i) for i in (4, 3, 5, 6, 7)] == [b" Hello", b" ", b" ", b"world", b"\n"]
