import pytest

from wrappers.read_schedule import ReadSchedule


def test_reads_resets_episode_ends_and_every_chunk_th_step_since_the_reset():
    schedule = ReadSchedule()
    assert [schedule.count_step(done=False) for _ in range(3)] == [True] * 3  # every step until told otherwise
    schedule.set_every(4)
    schedule.reset()
    predicted = []
    read = []
    for step in range(1, 10):
        predicted.append(schedule.must_read_next())
        read.append(schedule.count_step(done=step == 6))
    assert read == [False, False, False, True, False, True, False, True, False]
    assert predicted == [False, False, False, True, False, False, False, True, False]  # an end is not foreseen
    schedule.reset()
    assert [schedule.count_step(done=False) for _ in range(4)] == [False, False, False, True]


@pytest.mark.parametrize("chunk", [0, -1, 2.0, True])
def test_refuses_a_chunk_that_is_not_a_positive_int(chunk):
    with pytest.raises((TypeError, ValueError), match="set_read_every: chunk"):
        ReadSchedule().set_every(chunk)
