from hpc_rlhf.agents.openai_guard import bearer_key, bearer_token


def test_the_bearer_scheme_is_read_in_any_case_and_no_other_scheme_gives_a_key():
    for value in ("Bearer ep-1", "bearer ep-1", "BEARER  ep-1 ", " Bearer ep-1"):
        assert bearer_token(value) == "ep-1", value
    for value in ("Basic ep-1", "ep-1", "", None, "Bearer"):
        assert bearer_token(value) == "", value
    assert bearer_key([(b"Authorization", b"bearer ep-2")]) == "ep-2"
