from gspo.tasks.arithmetic import exact_match_reward, extract_answer, make_splits


def test_splits_are_seeded_disjoint_and_correct():
    train, held_out = make_splits(500, 50, digits=2, operations="+-", seed=3)
    assert (train, held_out) == make_splits(500, 50, digits=2, operations="+-", seed=3)
    assert len(train) == 500 and len(held_out) == 50
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    for row in train + held_out:
        expr = row["prompt"].rstrip("=")
        assert int(row["answer"]) == eval(expr)  # an independent evaluator of the expression


def test_exact_match_reward():
    assert exact_match_reward("132", answer="132") == 1.0
    assert exact_match_reward("  132\n", answer="132") == 1.0
    assert exact_match_reward("-7", answer="-7") == 1.0
    assert exact_match_reward("131", answer="132") == 0.0
    assert exact_match_reward("13 2", answer="132") == 0.0


def test_malformed_answers_score_zero_without_raising():
    for bad in ["", "abc", "132abc", "1+1", "=", None, "\x00", "9" * 10_000 + "x"]:
        assert exact_match_reward(bad, answer="132") == 0.0
    assert extract_answer("x") is None
