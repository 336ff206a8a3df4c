"""Loads the config.json of a Hugging Face folder exported by Titan with transformers.

    hf_config_check.py HF_DIR OUT_JSON

Writes OUT_JSON: {"available": true, "version": ..., "warnings": [...],
"max_position_embeddings": N}, the warnings being every message
transformers logged at WARNING or above, or emitted with `warnings`, while
AutoConfig.from_pretrained(HF_DIR) ran (its rope_scaling validation logs
there); or {"available": false, "error": ...} when transformers is not
importable. Only transformers is needed (no torch). Nothing here shares
code with Titan.
"""
import json
import logging
import sys
import warnings


class Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def main():
    hf_dir, out_path = sys.argv[1:3]
    try:
        import transformers
    except ImportError as e:
        report = {"available": False, "error": str(e)}
    else:
        handler = Collect()
        logger = logging.getLogger("transformers")
        logger.addHandler(handler)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cfg = transformers.AutoConfig.from_pretrained(hf_dir)
        logger.removeHandler(handler)
        report = {"available": True, "version": transformers.__version__,
                  "warnings": handler.messages + [str(w.message) for w in caught],
                  "max_position_embeddings": cfg.max_position_embeddings}
    with open(out_path, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
