"""Encodes texts with the `tokenizers` library from tokenizer.json files Titan wrote.

    tokenizer_file_check.py CASES_JSON OUT_JSON

CASES_JSON is {"files": [path, ...], "texts": [text, ...]}. Writes OUT_JSON:
{"available": true, "version": ..., "files": [{"path": ..., "error": null or
the message Tokenizer.from_file gave, "ids": [[...] per text]}]}, or
{"available": false, "error": ...} when `tokenizers` is not importable.

Texts are encoded as Titan encodes a document's text: no post-processor
tokens, and special-token text inside a text split as plain text
(encode_special_tokens, what transformers' split_special_tokens sets).
Nothing here shares code with Titan.
"""
import json
import sys


def main():
    cases_path, out_path = sys.argv[1:3]
    with open(cases_path) as f:
        cases = json.load(f)
    try:
        import tokenizers
    except ImportError as e:
        report = {"available": False, "error": str(e)}
    else:
        files = []
        for path in cases["files"]:
            try:
                tok = tokenizers.Tokenizer.from_file(path)
            except Exception as e:  # the library's own message is the finding
                files.append({"path": path, "error": str(e), "ids": None})
                continue
            tok.encode_special_tokens = True
            ids = [tok.encode(t, add_special_tokens=False).ids for t in cases["texts"]]
            files.append({"path": path, "error": None, "ids": ids})
        report = {"available": True, "version": tokenizers.__version__, "files": files}
    with open(out_path, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
