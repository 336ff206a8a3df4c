"""Checks the tokenizer files of a Hugging Face folder exported by Titan.

    hf_tokenizer_check.py HF_DIR CASES_JSON OUT_JSON

CASES_JSON is a list of {"text": ..., "ids": [...]}: Titan's encoding of the
text with BOS in front (how Titan trains and prompts). Writes OUT_JSON:

  tokenizers:   the `tokenizers` library's Tokenizer.from_file(tokenizer.json),
                with encode_special_tokens as tokenizer_config.json's
                split_special_tokens says (tokenizer.json cannot carry it):
                for each case, encode(text).ids == ids and
                decode(ids, skip_special_tokens=True) == text; or
                {"available": false} when it is not importable;
  transformers: AutoTokenizer.from_pretrained(HF_DIR): the same two checks,
                and its bos/eos ids against config.json's; or
                {"available": false}.

Each check reports the first case that differs. Nothing here shares code
with Titan.
"""
import json
import os
import sys


def first_mismatch(encode, decode, cases):
    for c in cases:
        got = encode(c["text"])
        if got != c["ids"]:
            return f"encode({c['text']!r}) = {got}, Titan's {c['ids']}"
        back = decode(c["ids"])
        if back != c["text"]:
            return f"decode({c['ids']}) = {back!r}, expected {c['text']!r}"
    return None


def main():
    hf_dir, cases_path, out_path = sys.argv[1:4]
    with open(cases_path) as f:
        cases = json.load(f)
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(hf_dir, "tokenizer_config.json")) as f:
        tok_cfg = json.load(f)
    report = {}

    try:
        import tokenizers
        tok = tokenizers.Tokenizer.from_file(os.path.join(hf_dir, "tokenizer.json"))
        tok.encode_special_tokens = bool(tok_cfg.get("split_special_tokens", False))
        err = first_mismatch(lambda t: tok.encode(t).ids, lambda ids: tok.decode(ids, skip_special_tokens=True), cases)
        report["tokenizers"] = {"available": True, "version": tokenizers.__version__, "ok": err is None, "error": err}
    except ImportError as e:
        report["tokenizers"] = {"available": False, "error": str(e)}

    try:
        import transformers
        tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
        err = first_mismatch(lambda t: tok(t)["input_ids"], lambda ids: tok.decode(ids, skip_special_tokens=True), cases)
        if err is None and (tok.bos_token_id, tok.eos_token_id) != (cfg.get("bos_token_id"), cfg.get("eos_token_id")):
            err = (f"AutoTokenizer's bos/eos ids {tok.bos_token_id}/{tok.eos_token_id}, config.json's "
                   f"{cfg.get('bos_token_id')}/{cfg.get('eos_token_id')}")
        report["transformers"] = {"available": True, "version": transformers.__version__, "ok": err is None,
                                  "error": err}
    except ImportError as e:
        report["transformers"] = {"available": False, "error": str(e)}

    with open(out_path, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
