"""A reward a tiny random model learns in a few dozen rollouts: how many of its characters are a 7."""


def seven(prompt, response, label):
    return response.count("7") / max(len(response), 1)
