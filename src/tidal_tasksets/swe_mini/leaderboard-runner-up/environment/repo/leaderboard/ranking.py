"""Scores and rankings for the tournament page."""


def best_score(scores):
    """The highest score, or None when there are no scores."""
    return max(scores) if scores else None


def runner_up(scores):
    """The second-highest distinct score, or None when there is none."""
    if len(scores) < 2:
        return None
    ordered = sorted(scores, reverse=True)
    return ordered[1]


def ranks(results):
    """Competition ranking ("1224") of {player: score}: ties share a rank and the next
    rank skips. Returns {player: rank}."""
    ordered = sorted(results.items(), key=lambda item: (-item[1], item[0]))
    out = {}
    previous = None
    for position, (player, score) in enumerate(ordered, 1):
        if previous is not None and score == previous[1]:
            out[player] = out[previous[0]]
        else:
            out[player] = position
        previous = (player, score)
    return out
