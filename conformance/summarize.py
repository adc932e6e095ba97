"""Summarise the reference suite: reference (BERT/GPT-2/BART) results next to coreformer's, per test name.

usage: python summarize.py REF.xml OURS.xml OUT.json [--details]

A test name is the method name (with its parameterisation suffix). "Comparable" = names at least one in-library
reference passes. For coreformer a name passes when every one of our classes that has it passes it; it fails when
any of them fails or errors; it is skipped when all that have it skip it; "absent" when none of our classes has it
(a model-specific reference test with no counterpart).
"""

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict

REFERENCES = {"BertModelTest": "bert", "GPT2ModelTest": "gpt2", "BartModelTest": "bart"}
OURS = {
    "CoreformerEncoderModelTest": "encoder",
    "CoreformerDecoderModelTest": "decoder",
    "CoreformerSeq2SeqModelTest": "seq2seq",
    "CoreformerDecoderLlamaSlidingModelTest": "dec_sliding",
}
PAIRS = {"encoder": "bert", "decoder": "gpt2", "seq2seq": "bart", "dec_sliding": "gpt2"}
# The headline mirrors the references one to one; the sliding variant is reported on its own.
HEADLINE = ("encoder", "decoder", "seq2seq")
RANK = {"pass": 0, "skip": 1, "fail": 2}


def read(path: str) -> dict:
    """{(class, test): (status, reason)}; subtest entries fold into their test (any failure fails it)."""
    results = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        cls = case.get("classname", "").rsplit(".", 1)[-1]
        name = case.get("name")
        status, reason = "pass", ""
        for tag in ("failure", "error"):
            node = case.find(tag)
            if node is not None:
                status = "fail"
                text = (node.get("message") or node.text or "").strip()
                reason = text.splitlines()[0][:300] if text else tag
        node = case.find("skipped")
        if status == "pass" and node is not None:
            status = "skip"
            reason = (node.get("message") or "").strip().splitlines()[0][:200] if node.get("message") else ""
        key = (cls, name)
        if key not in results or RANK[status] > RANK[results[key][0]]:
            results[key] = (status, reason)
    return results


def main() -> None:
    ref, ours, out = read(sys.argv[1]), read(sys.argv[2]), sys.argv[3]
    for label, results in (("reference", ref), ("coreformer", ours)):
        broken = [name for (cls, name) in results if not cls]
        if broken or not any(cls in REFERENCES or cls in OURS for cls, _ in results):
            sys.exit(f"the {label} run did not collect (collection errors: {broken}); see its .log")
    by_name = defaultdict(dict)  # name -> {short class name: (status, reason)}
    for (cls, name), value in list(ref.items()) + list(ours.items()):
        short = REFERENCES.get(cls) or OURS.get(cls)
        if short:
            by_name[name][short] = value

    rows = []
    for name in sorted(by_name):
        entry = by_name[name]
        ref_statuses = {short: entry[short][0] for short in REFERENCES.values() if short in entry}
        our_statuses = {short: entry[short][0] for short in OURS.values() if short in entry}
        headline = [status for short, status in our_statuses.items() if short in HEADLINE]
        if not headline:
            ours_overall = "absent"
        elif "fail" in headline:
            ours_overall = "fail"
        elif "pass" in headline:
            ours_overall = "pass"
        else:
            ours_overall = "skip"
        rows.append(
            {
                "test": name,
                "reference": ref_statuses,
                "ours": our_statuses,
                "comparable": "pass" in ref_statuses.values(),
                "ours_overall": ours_overall,
                "reasons": {short: entry[short][1] for short in entry if entry[short][1]},
            }
        )

    comparable = [row for row in rows if row["comparable"]]
    counts = defaultdict(int)
    for row in comparable:
        counts[row["ours_overall"]] += 1
    per_family = {}
    for our, reference in PAIRS.items():
        paired = [row for row in rows if row["reference"].get(reference) == "pass" and our in row["ours"]]
        per_family[f"{our} vs {reference}"] = {
            "reference_passes_and_ours_has": len(paired),
            "ours_pass": sum(row["ours"][our] == "pass" for row in paired),
            "ours_fail": sum(row["ours"][our] == "fail" for row in paired),
            "ours_skip": sum(row["ours"][our] == "skip" for row in paired),
        }
    headline_pairs = {key: sum(per_family[f"{our} vs {PAIRS[our]}"][key] for our in HEADLINE) for key in per_family["encoder vs bert"]}
    # Every (our class, test) that fails where its paired reference passes, sliding variant included.
    failing = [
        {"test": row["test"], "ours": row["ours"], "reasons": {k: v for k, v in row["reasons"].items() if row["ours"].get(k) == "fail"}}
        for row in rows
        if any(row["ours"].get(our) == "fail" and row["reference"].get(ref) == "pass" for our, ref in PAIRS.items())
        or (row["comparable"] and row["ours_overall"] == "fail")
    ]
    # Tests ours fail that no reference passes (not comparable, listed for information).
    failing_not_comparable = [row["test"] for row in rows if not row["comparable"] and row["ours_overall"] == "fail"]
    summary = {
        "comparable": len(comparable),
        "comparable_ours_pass": counts["pass"],
        "comparable_ours_fail": counts["fail"],
        "comparable_ours_skip": counts["skip"],
        "comparable_ours_absent": counts["absent"],
        "comparable_present_in_ours": len(comparable) - counts["absent"],
        "per_family": per_family,
        "paired_headline": headline_pairs,
        "failing": failing,
        "failing_not_comparable": failing_not_comparable,
        "skipped_where_paired_reference_passes": [
            {"test": row["test"], "class": our, "reason": row["reasons"].get(our, "")}
            for row in rows
            for our, ref in PAIRS.items()
            if row["ours"].get(our) == "skip" and row["reference"].get(ref) == "pass"
        ],
        "absent_in_ours": [row["test"] for row in comparable if row["ours_overall"] == "absent"],
        "rows": rows,
    }
    with open(out, "w") as handle:
        json.dump(summary, handle, indent=1)

    if "--details" in sys.argv:
        print(f"{'test':<75} {'bert':>5} {'gpt2':>5} {'bart':>5} | {'enc':>5} {'dec':>5} {'s2s':>5} {'slide':>5}")
        for row in rows:
            cells = [row["reference"].get(s, "-") for s in ("bert", "gpt2", "bart")]
            cells += [row["ours"].get(s, "-") for s in ("encoder", "decoder", "seq2seq", "dec_sliding")]
            print(f"{row['test'][:75]:<75} " + " ".join(f"{c:>5}" for c in cells[:3]) + " | " + " ".join(f"{c:>5}" for c in cells[3:]))
    print()
    print("paired (encoder~BERT, decoder~GPT-2, seq2seq~BART; the test ran in both and the reference passed):")
    print(f"  comparable {headline_pairs['reference_passes_and_ours_has']}: ours pass {headline_pairs['ours_pass']}, "
          f"fail {headline_pairs['ours_fail']}, skip {headline_pairs['ours_skip']}")
    print(f"by test name (comparable = any of BERT/GPT-2/BART passes): {len(comparable)}")
    print(f"  present in ours: {len(comparable) - counts['absent']}  (absent: {counts['absent']}, model-specific)")
    print(f"  ours pass: {counts['pass']}   ours fail: {counts['fail']}   ours skip: {counts['skip']}")
    for family, numbers in per_family.items():
        print(f"  {family}: {numbers}")
    print(f"\nfailing tests ({len(failing)} names; [class]: first line of the error):")
    for row in failing:
        for short, reason in row["reasons"].items():
            print(f"  {row['test']} [{short}]: {reason}")
    skipped = [
        (row["test"], our, row["reasons"].get(our, ""))
        for row in rows
        for our, ref in PAIRS.items()
        if row["ours"].get(our) == "skip" and row["reference"].get(ref) == "pass"
    ]
    print(f"\nskipped by ours where the paired reference passes ({len(skipped)}):")
    for test, our, reason in skipped:
        print(f"  {test} [{our}]: {reason}")
    if failing_not_comparable:
        print(f"\nours fail, no reference passes ({len(failing_not_comparable)}): {', '.join(failing_not_comparable)}")
    print(f"\nJSON: {out}")


if __name__ == "__main__":
    main()
