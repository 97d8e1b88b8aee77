"""A toy theory-of-mind task for Social-R1's reward in miniature (data.py's `toy_tom`), in English
and Chinese like the demo's: a false-belief (unexpected transfer) story and a lettered
multiple-choice question.

    Anna puts the ball in the basket. / Anna goes out to the garden. / Ben moves the ball to the
    box. / Anna comes back.   Where will Anna look for the ball first?  A. the basket  B. the
    box  C. the drawer  D. the bag

The person who put the thing away either leaves (and so believes it is still where they put it) or
stays and watches the move (and knows where it is); the question asks where they will look first,
or where the thing is now. The line that settles it, "goes out" or "stays and watches", is the one
to quote. Chance is 25%.

The options keep one order: the place the thing was put first (A), the place it was moved to (B),
then two others. With the options shuffled, the demo's 0.7M-parameter model, trained for minutes,
did not learn to find an option by its text (measured on seed 0: 26.0% held-out accuracy after
SFT, 27.6% after GRPO, chance 25%), so the toy asks for the reasoning (who saw the move, which
question) and not for the lookup of a letter.

Each story carries its reference analysis in the four stages of Social Information Processing
(`meta.reference`: Encoding, Interpretation, Goal, Response, then the answer; the yardstick of
R_content), and its SFT trace is one of three kinds, drawn per story (TomData's shares), so that
each of Social-R1's reward terms has something to change (the rules judges' scores, which
tests/tools/test_ablate.py checks):

| kind | blocks | R_struct | R_content | R_len |
|---|---|---|---|---|
| full | the four stages, the decisive line quoted | 1 | 1 | ~1 (inside the window) |
| short | Encoding and Response only | 0.5 | 0.5 (no Interpretation) | low (too short) |
| padded | full, its Encoding said three times | 1 | 1 | low (repetition) |

All three answer right. The window of R_len is scaled to these lengths in
configs/toy_tom_grpo.yaml.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from data import THINK_END, THINK_START, Example, Turn
from dataset import check_example
from demo import LANGUAGES, ModelSize, draw_examples
from verifier import EVIDENCE_CLOSE, EVIDENCE_OPEN

TASK = "toy_tom"


@dataclass(frozen=True)
class Words:
    """What the stories, references and traces of one language are made of."""

    things: tuple[str, ...]
    places: tuple[str, ...]
    put: str  # {who} {thing} {place}
    leaves: tuple[str, ...]  # {who}: the line that settles a false belief
    stays: str  # {who}: the line that settles a true one
    moves: str  # {who} {thing} {place}
    returns: str  # {who}
    fillers: tuple[str, ...]  # {who}: a line that changes nothing
    look: str  # the belief question: {who} {thing}
    now: str  # the reality question: {thing}
    option: str  # {place}
    # the stages' prose: {who}, {thing}, {place}, {letter}
    unseen: str
    seen: str
    real: str
    goal_belief: str
    goal_real: str
    answer_belief: str
    answer_real: str


WORDS = {
    "en": Words(
        ("ball", "key", "book", "apple", "hat", "cake"),
        ("basket", "box", "drawer", "bag", "cupboard", "jar"),
        "{who} puts the {thing} in the {place}.",
        ("{who} goes out to the garden.", "{who} leaves for school.", "{who} goes to sleep."),
        "{who} stays and watches.",
        "{who} moves the {thing} to the {place}.",
        "{who} comes back.",
        ("{who} is reading a book.", "{who} opens the window.", "{who} drinks some tea."),
        "Where will {who} look for the {thing} first?",
        "Where is the {thing} now?",
        "the {place}",
        "{who} did not see the move: {who} thinks the {thing} is in the {place}.",
        "{who} saw the move: {who} knows the {thing} is in the {place}.",
        "The {thing} was moved: it is in the {place}.",
        "{who} wants the {thing}.",
        "Where the {thing} really is.",
        "{who} looks in the {place}: {letter}.",
        "In the {place}: {letter}.",
    ),
    "zh": Words(
        ("球", "钥匙", "书", "苹果", "帽子", "蛋糕"),
        ("篮子", "盒子", "抽屉", "包", "柜子", "罐子"),
        "{who}把{thing}放进了{place}。",
        ("{who}去花园了。", "{who}去上学了。", "{who}去睡觉了。"),
        "{who}留在屋里看着。",
        "{who}把{thing}挪到了{place}。",
        "{who}回来了。",
        ("{who}在看书。", "{who}打开了窗户。", "{who}在喝茶。"),
        "{who}会先去哪里找{thing}？",
        "{thing}现在在哪里？",
        "{place}",
        "{who}没看到挪动，以为{thing}在{place}里。",
        "{who}看到了挪动，知道{thing}在{place}里。",
        "{thing}被挪走了，在{place}里。",
        "{who}想要{thing}。",
        "{thing}实际在哪里。",
        "{who}去{place}里找：{letter}。",
        "在{place}里：{letter}。",
    ),
}
SIP_HEADS = ("Encoding", "Interpretation", "Goal", "Response")  # judge.SIP_STAGES' order
LETTERS = "ABCD"


def tom_example(rng: random.Random, language: str, example_id: str) -> Example:
    """One story: A puts a thing somewhere; A leaves (false belief) or stays and watches (true
    belief); B moves it; a bystander's line may come anywhere after the first; A comes back if A
    left. The question: where A will look first (belief, 70%), or where the thing is now. `meta`
    holds the question, the options, what the story is (`kind`, `left`, `who`, `thing`, `first`,
    `moved`, `cues`: the three lines that matter, the second the one that decides) and the
    reference analysis."""
    words, names = WORDS[language], LANGUAGES[language].names
    who, mover, bystander = rng.sample(names, 3)
    thing = rng.choice(words.things)
    first, moved, *others = rng.sample(words.places, 4)
    left = rng.random() < 0.5
    cues = [
        words.put.format(who=who, thing=thing, place=first),
        (rng.choice(words.leaves) if left else words.stays).format(who=who),
        words.moves.format(who=mover, thing=thing, place=moved),
    ]
    lines = cues + ([words.returns.format(who=who)] if left else [])
    if rng.random() < 0.5:
        lines.insert(rng.randint(1, len(lines)), rng.choice(words.fillers).format(who=bystander))
    belief = rng.random() < 0.7
    places = [first, moved, *others]  # the option order: see the module's docstring
    answer = first if belief and left else moved
    letter = LETTERS[places.index(answer)]
    meta = {
        "question": words.look.format(who=who, thing=thing)
        if belief
        else words.now.format(thing=thing),
        "options": [words.option.format(place=p) for p in places],
        "kind": "belief" if belief else "reality",
        "left": left,
        "who": who,
        "thing": thing,
        "first": first,
        "moved": moved,
        "cues": cues,
    }
    example = Example(
        example_id,
        TASK,
        [Turn("", line) for line in lines],
        None,
        [letter],
        language=language,
        difficulty=float(len(lines) > 4),
        meta=meta,
    )
    example.meta["reference"] = "\n".join(
        [f"{head}: {text}" for head, text in zip(SIP_HEADS, stages(example, quoted=False))]
        + [f"Answer: {letter}"]
    )
    return check_example(example)


def stages(example: Example, quoted: bool = True) -> list[str]:
    """The four SIP stages' text for `example`: Encoding (the line that decides, between evidence
    tags when `quoted`), Interpretation, Goal, Response."""
    m, words = example.meta, WORDS[example.language]
    tag = (lambda s: f"{EVIDENCE_OPEN}{s}{EVIDENCE_CLOSE}") if quoted else (lambda s: s)
    who, thing, letter = m["who"], m["thing"], example.labels[0]
    if m["kind"] == "reality":
        interpretation = words.real.format(thing=thing, place=m["moved"])
        goal = words.goal_real.format(thing=thing)
        response = words.answer_real.format(thing=thing, place=m["moved"], letter=letter)
    else:
        known = m["first"] if m["left"] else m["moved"]
        interpretation = (words.unseen if m["left"] else words.seen).format(
            who=who, thing=thing, place=known
        )
        goal = words.goal_belief.format(who=who, thing=thing)
        response = words.answer_belief.format(who=who, place=known, letter=letter)
    return [tag(m["cues"][1]), interpretation, goal, response]


def tom_trace(example: Example, kind: str) -> str:
    """The SFT completion of a story, of kind full, short or padded (the module's table)."""
    encoding, interpretation, goal, response = stages(example)
    blocks = {
        "full": [encoding, interpretation, goal, response],
        "short": [encoding, response],
        "padded": [encoding, encoding, encoding, interpretation, goal, response],
    }[kind]
    heads = {
        "full": SIP_HEADS,
        "short": (SIP_HEADS[0], SIP_HEADS[3]),
        "padded": (SIP_HEADS[0], SIP_HEADS[0], *SIP_HEADS),
    }[kind]
    body = "\n\n".join(f"{head}: {text}" for head, text in zip(heads, blocks))
    return f"{THINK_START}\n{body}\n{THINK_END}\n\nAnswer: {example.labels[0]}"


def story_key(example: Example) -> tuple:
    return (*(t.text for t in example.turns), example.meta["question"], *example.meta["options"])


@dataclass
class TomData:
    """The sizes of what an ablation builds for toy_tom (demo.prepare's spec, in demo.json)."""

    seed: int = 0
    train: int = 2400  # stories: SFT rows (with their traces) and the RL prompts
    heldout: int = 1000  # stories for the evaluation, none of them in `train`
    full: float = 0.4  # the shares of the SFT trace kinds; padded takes the rest
    short: float = 0.3
    vocab_size: int = 2048
    model: ModelSize = field(default_factory=ModelSize)


def tom_stories(n: int, seed: int, split: str, exclude: frozenset = frozenset()) -> list[Example]:
    """`n` stories, deterministic for (seed, split) (demo.draw_examples); a story in `exclude`
    (story_key) is drawn again."""
    rng = random.Random(f"tom/{seed}/{split}")
    return draw_examples(n, rng, tom_example, f"tom-{split}", story_key, exclude)


def tom_data(spec: TomData) -> tuple[list[Example], list[Example], list[str]]:
    """(training stories, held-out stories, the training stories' SFT traces): demo.prepare's
    `make` for toy_tom."""
    train = tom_stories(spec.train, spec.seed, "train")
    heldout = tom_stories(
        spec.heldout, spec.seed, "heldout", frozenset(story_key(e) for e in train)
    )
    rng = random.Random(f"tom/{spec.seed}/traces")

    def kind() -> str:
        x = rng.random()
        return "full" if x < spec.full else "short" if x < spec.full + spec.short else "padded"

    return train, heldout, [tom_trace(e, kind()) for e in train]
