"""`lopd model new|prepare|info` and `lopd base`: build, prepare and inspect models."""

from __future__ import annotations

from lopd.cli.common import add_command, add_env_arg, config_for_env, load
from lopd.tables import format_table, key_value_table, write_json


def checks_table(checks: list[dict]) -> str:
    """The chat-template checks of :func:`lopd.agent.check_chat_template` as a table."""
    rows = [[c["check"], "ok" if c["ok"] else "FAIL" if c["required"] else "no", c["detail"]]
            for c in checks]
    return format_table(["chat template check", "result", "detail"], rows)


def cmd_model_new(args) -> int:
    from lopd import pipeline
    from lopd.corpus import read_corpus, synthetic_transcripts

    cfg = load(args)
    corpus = read_corpus(args.corpus) if args.corpus else synthetic_transcripts(seed=cfg.run.seed)
    figures = pipeline.build_and_save(cfg, corpus, args.out)
    print(key_value_table(figures, title=f"built {figures['path']}"))
    write_json(args.json_path, figures)
    return 0


def cmd_model_prepare(args) -> int:
    from lopd import pipeline

    figures = pipeline.prepare_model(load(args), args.source, args.out, args.chat_template,
                                     args.dtype)
    print(key_value_table({k: v for k, v in figures.items() if k != "checks"},
                          title=f"prepared {figures['source']} -> {figures['out']}"))
    print()
    print(checks_table(figures["checks"]))
    write_json(args.json_path, figures)
    return 0


def cmd_model_info(args) -> int:
    from lopd import pipeline

    cfg = load(args)
    info = pipeline.model_info(args.path, trust_remote_code=cfg.model.trust_remote_code)
    print(key_value_table({k: v for k, v in info.items() if k != "checks"},
                          title=f"model {info['path']}"))
    print()
    print(checks_table(info["checks"]))
    write_json(args.json_path, info)
    return 0


def cmd_base(args) -> int:
    from lopd.base_model import build_base

    cfg = config_for_env(args)
    result = build_base(cfg, args.out, resume=args.resume)
    print(key_value_table(result, title=f"base model -> {args.out}"))
    write_json(args.json_path, result)
    return 0


def register(sub) -> None:
    p = add_command(sub, "base", cmd_base, "build the vanilla base model (tokenizer, Qwen3, SFT)",
                    "Train a tokenizer on environment transcripts, build the Qwen3 model and "
                    "fine-tune it on oracle transcripts of the pre-training pool until validation "
                    "success (on training-split tasks) reaches base.stop_at_success.")
    p.add_argument("--out", required=True, help="folder to write the base model to")
    add_env_arg(p, default=None, help="environment to build it for: toolworld (the default preset "
                "tiny) or codeworld (preset tiny-code unless --config says otherwise)")
    p.add_argument("--resume", action="store_true",
                   help="continue the training checkpointed in --out (same config; a run stopped "
                   "by base.time_limit_minutes continues where it stopped)")

    model = sub.add_parser("model", help="build, prepare or inspect models",
                           description="Build the tiny default model, prepare any Hugging Face "
                           "causal LM for lopd, or inspect a model folder.")
    msub = model.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    p = add_command(msub, "new", cmd_model_new,
                    "train a tokenizer and build a random-initialised tiny model",
                    "Train a byte-level BPE tokenizer on a corpus and build a Qwen3 model from the "
                    "config's model.architecture, seeded by run.seed; saved in Hugging Face "
                    "format.")
    p.add_argument("--out", required=True, help="folder to write the model and tokenizer to")
    p.add_argument("--corpus", help="tokenizer corpus: .txt (one text per line) or .jsonl "
                   "('text' field); default: built-in synthetic tool-use transcripts")

    p = add_command(msub, "prepare", cmd_model_prepare,
                    "make any Hugging Face causal LM ready for lopd (<|latent|>, template checks)",
                    "Load a Hugging Face model folder (--set model.trust_remote_code=true for "
                    "models that ship their own code), add the <|latent|> sentinel if absent "
                    "(a special token; embeddings resized, the new row the mean of the existing "
                    "ones), make generation stop at the chat template's end-of-turn token, check "
                    "that the template renders a system message with tools, a tool-call turn, a "
                    "tool result and the reference block, and write the model and tokenizer to "
                    "--out. Nothing is written when a check fails.")
    p.add_argument("source", help="Hugging Face model folder, a GGUF file (or a folder holding "
                   "one; dequantised and written as a plain folder), or an embedded model name")
    p.add_argument("--out", required=True, help="folder to write the prepared model to")
    p.add_argument("--chat-template", metavar="NAME_OR_FILE",
                   help="install this chat template instead of the tokenizer's own: a template "
                   "lopd ships (chatml-tools: ChatML with tools as JSON in the system message, "
                   "calls as <tool_call>{json}</tool_call>, results in a tool turn) or a Jinja "
                   "file; for models whose own template has no tools. The folder records it.")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="weights of the prepared model: the checkpoint's own (auto; float32 for a "
                   "GGUF file), or converted")

    p = add_command(msub, "info", cmd_model_info,
                    "parameters, vocabulary, <|latent|>, chat-template checks of a model folder",
                    "Print facts about a saved model: parameter count, shape, vocabulary, special "
                    "tokens, whether <|latent|> is present and whether its chat template passes "
                    "the checks lopd needs (those of `lopd model prepare`).")
    p.add_argument("path", help="model folder, or an embedded model name (toolworld-1m, ...)")
