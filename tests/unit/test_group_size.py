"""samples_per_task = "auto": groups sized from the servers' caps, the task threads, and the answers' rate."""

from tokenfleet.publish import MAX_GROUP, TASKS_PER_S, GroupSizer, group_for_rate, group_size


def test_groups_hold_about_three_times_the_servers_caps_over_the_task_threads_online() -> None:
    assert group_size(64, task_threads=64) == 3
    assert group_size(1024, task_threads=64) == 48  # a default worker on two cores, one 1,024-slot server


def test_a_group_is_never_larger_than_the_cap() -> None:
    assert group_size(8 * 1024, task_threads=32) == MAX_GROUP


def test_with_no_task_threads_counted_a_server_batch_is_eight_messages_of_at_most_32() -> None:
    assert group_size(64) == 8
    assert group_size(None) == 32  # caps unknown: taken as 256
    assert group_size(1024) == 32  # the first messages spread over the workers that come


def test_a_slow_dataset_needs_no_larger_group_for_its_rate() -> None:
    assert group_for_rate(0.0) == 1
    assert group_for_rate(TASKS_PER_S) == 1


def test_a_fast_dataset_gets_the_least_power_of_two_group_within_the_messages_a_second() -> None:
    assert group_for_rate(TASKS_PER_S * 1.1) == 2
    assert group_for_rate(600.0) == 16  # 7-token answers at 64 in flight: 600 / 40 = 15
    assert group_for_rate(1e9) == MAX_GROUP


def test_the_sizer_takes_the_larger_of_the_two_sizes_and_never_shrinks_one_for_the_rate() -> None:
    rates = {"fast": 600.0}
    said: list[str] = []
    sizer = GroupSizer({"fast": 64}, say=said.append, task_threads=lambda: 64, rate=lambda n: rates[n])

    assert sizer("fast") == 16
    rates["fast"] = 10.0  # the dataset's end: few answers left
    assert sizer("fast") == 16
    assert said == [
        "fast: 16 sample(s) per task (64 generations at once on its servers, 64 task threads online; "
        "600 answers/s)"
    ]


def test_the_sizer_keeps_the_caps_size_while_the_rate_is_unknown() -> None:
    sizer = GroupSizer({"d": 64}, task_threads=lambda: 64)
    assert sizer("d") == 3


def test_the_sizer_says_when_the_cap_leaves_fewer_than_three_samples_per_slot() -> None:
    said: list[str] = []
    sizer = GroupSizer({"big": 2048}, say=said.append, task_threads=lambda: 32)

    assert sizer("big") == MAX_GROUP
    assert said == [
        f"big: {MAX_GROUP} sample(s) per task (2,048 generations at once on its servers, 32 task threads "
        f"online; at most {MAX_GROUP} a task, so the workers hold 2.0 samples per slot, not 3: more worker "
        "processes would keep the servers fuller)"
    ]


def test_the_sizer_says_nothing_of_the_cap_where_it_does_not_bind() -> None:
    said: list[str] = []
    sizer = GroupSizer({"d": 1024}, say=said.append, task_threads=lambda: 64)

    assert sizer("d") == 48
    assert said == [
        "d: 48 sample(s) per task (1,024 generations at once on its servers, 64 task threads online)"
    ]
