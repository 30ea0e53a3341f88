"""A slow stage's progress: its fraction, and the time left once the pace means something."""

from specplay.core.progress import counting_down


def test_a_stage_reports_its_fraction_and_the_time_left_from_its_pace():
    now = [100.0]
    seen = []
    report = counting_down(lambda stage, fraction: seen.append((stage, fraction)), "Fitting the draft",
                           clock=lambda: now[0])
    report(0.0)
    now[0] += 1.0
    report(0.5)  # a second in: too early to say
    now[0] += 3.0
    report(0.8)  # 4 s for 80%: 1 s left
    now[0] += 60.0
    report(0.81)  # 64 s for 81%: 15 s left
    report(1.0)
    assert seen == [("Fitting the draft", 0.0), ("Fitting the draft", 0.5),
                    ("Fitting the draft: about 1 s left", 0.8), ("Fitting the draft: about 15 s left", 0.81),
                    ("Fitting the draft", 1.0)]
    slow = counting_down(lambda stage, fraction: seen.append(stage), "Assembling", clock=lambda: now[0])
    now[0] += 600.0
    slow(0.1)
    assert seen[-1] == "Assembling: about 90 min left"
