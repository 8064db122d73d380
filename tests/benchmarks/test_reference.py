"""benchmarks/reference.py without the reference says in one line what it needs, and its side of
ours decodes the spec it hands both sides (the side-by-side run itself needs the reference's
checkout and environment: benchmarks/PERFORMANCE.md, "Against the reference")."""

from benchmarks import reference


def test_without_the_reference_it_says_what_it_needs(capsys, tmp_path):
    assert reference.main([]) is None
    assert reference.main(["--setdlm", str(tmp_path)]) is None  # not a checkout
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and all("needs --setdlm DIR" in line and "PERFORMANCE.md" in line for line in lines)


def test_our_side_decodes_the_spec_one_token_a_step():
    spec = reference.spec(prompt_len=6, new_tokens=8)
    assert spec["length"] == 14 and len(spec["prompt"]) == 6 and max(spec["prompt"]) < spec["size"]["vocab_size"] - 4
    run = reference.ours(spec, "off")
    assert run["new_tokens"] == 8 and run["steps"] == 8 and run["seconds"] > 0  # a random model: flat confidences
