"""``tether label-steps``: make step-labelled data (A9) from ``(prompt, response)`` rows with a step rule.

The rule is any callable ``module:function`` taking ``(prompts, steps, **columns)`` — ``steps`` one list of
step texts per row, split at ``--separator`` — and returning one list of labels (true = the step is right)
per row; e.g. ``tether.demo.steps:step_labels`` for the demo's step task. The output is JSONL in TRL's
stepwise shape (``prompt``, ``completions``, ``labels``), ready for ``tether train-rm --process``.
"""

from __future__ import annotations

from tether.errors import DataError


def add_arguments(parser) -> None:
    parser.add_argument("--input", required=True, help="rows with 'prompt' and 'response' (JSONL, CSV, Parquet, ...)")
    parser.add_argument("--rule", required=True, help="step rule module:function[:key=value,...]")
    parser.add_argument("--separator", default="\\n", help="the text between steps (\\n and \\t read as newline "
                        "and tab) [\\n]")
    parser.add_argument("--output", required=True, help="JSONL file to write (atomically)")


def run(args) -> int:
    from tether.inputs.records import read_records, record_location
    from tether.rules import load_rule
    from tether.rm.steps import label_with_rule, unescape_separator, write_step_examples

    separator = unescape_separator(args.separator)
    if not separator:
        raise DataError("--separator must not be empty")
    records = read_records(args.input)
    for number, record in records:
        for key in ("prompt", "response"):
            if not isinstance(record.get(key), str):
                raise DataError(f"{record_location(args.input, number)}: field '{key}' must be text")
    rule = load_rule(args.rule, flag="--rule")
    examples = label_with_rule([r for _, r in records], rule, separator)
    write_step_examples(examples, args.output)
    steps = sum(len(e.steps) for e in examples)
    good = sum(sum(e.labels) for e in examples)
    print(f"wrote {args.output}: {len(examples)} responses, {steps} steps, {good} labelled right")
    return 0
