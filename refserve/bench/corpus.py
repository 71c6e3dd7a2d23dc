"""Text bundled with the bench, written for it (no downloads): paragraphs to build long
prompts from, short questions, and chat turns. `passage()` assembles a prompt of about the
requested number of tokens, deterministically from a seed."""

from __future__ import annotations

import numpy as np

PARAGRAPHS = [
    "The harbour town of Wrenmouth keeps a ledger of every ship that ties up at its stone "
    "quay. The harbour master writes the name of the vessel, the hour of arrival, the cargo "
    "declared and the berth assigned. When the tide is low only the three inner berths can "
    "take a keel, so the master must decide who waits in the roads and who comes in first.",
    "A lighthouse keeper on the northern point trims the wick at dusk and again at midnight. "
    "Her log records the wind, the visibility and the ships she sees pass. On clear nights "
    "the beam reaches eighteen miles; in fog it is swallowed after two, and the keeper rings "
    "the bell every thirty seconds until the morning breeze clears the water.",
    "The rope walk behind the customs house is four hundred yards long. Spinners walk "
    "backwards along it paying out fibre from bundles at their waists while a boy turns the "
    "wheel. Three strands are laid into a rope, three ropes into a cable, and every length is "
    "tested by hanging a measured weight from it before it leaves the shed.",
    "Merchants who trade in salt fish keep their accounts in a simple way. Each barrel is "
    "numbered, each number has a line in the book, and a line is struck through only when "
    "the buyer has paid. Clerks count the open lines every evening; a barrel that stays open "
    "for a month is sent to the auction on the first Monday.",
    "The town's library occupies the upper floor of the old granary. Its shelves hold charts, "
    "tide tables, almanacs and a few hundred novels left by sailors. Borrowers may take two "
    "books at a time for fourteen days, and the librarian keeps a card for each book in a "
    "long drawer, sorted by the day it is due to come back.",
    "In winter the fishing fleet stays in port and the net makers work in the long hall by "
    "the market. A net is made of meshes of one size, knotted row by row from a single "
    "twine. A torn net is not thrown away: the damaged meshes are cut out and new ones are "
    "knotted into the hole until the pattern is whole again.",
    "Every spring the council surveys the sea wall. Surveyors walk its length with a chain "
    "and a level, marking each stone that has moved. Small gaps are packed with gravel and "
    "lime; a section that has slumped is taken down and rebuilt on a wider footing, because "
    "the winter storms always find the weakest place first.",
    "The ferry to the islands leaves at seven, eleven and four. It carries twelve passengers, "
    "the post, and whatever livestock the farmers need moved. The ferryman keeps a slate by "
    "the gangway with the names of those who have booked; a traveller without a booking "
    "boards only if a seat is left when the bell rings.",
    "Bakers in the lower town start work at three in the morning. Dough is mixed in large "
    "troughs, left to rise, cut into pieces of equal weight and shaped by hand. The ovens "
    "hold forty loaves at a time, so the baker plans the night in batches, and the first "
    "batch is always the bread the fishermen take to sea.",
    "The school by the church teaches forty children in two rooms. The younger ones learn "
    "letters and numbers from slates; the older ones study navigation, reading the stars "
    "and working out a ship's position from its speed, its heading and the hours it has "
    "sailed since the last known landmark.",
    "When a storm is forecast the harbour master raises a black cone on the signal mast. "
    "Boats already at sea run for shelter, and those in port double their mooring lines. "
    "After the storm, the master walks the quay to count the boats, and no one goes home "
    "until every name in the ledger has been ticked off.",
    "The market square fills on Saturdays. Stalls are allotted by the clerk of the market "
    "in the order the traders arrive, and a trader who leaves early gives up the pitch to "
    "the next in line. By noon the square is full, and latecomers set out their goods on "
    "the steps of the town hall.",
]

QUESTIONS = [
    "Who decides which ship comes in first?", "How far does the beam reach in fog?",
    "How long is the rope walk?", "When is a barrel sent to auction?",
    "How many books may a borrower take?", "What happens to a torn net?",
    "Why is a slumped section rebuilt wider?", "When does the ferry leave?",
    "Which batch of bread is baked first?", "What do the older children study?",
    "What does the black cone mean?", "Who allots the market stalls?",
    "What does the harbour master write down?", "How often is the bell rung in fog?",
    "How many strands make a rope?", "How are the clerks' accounts kept?",
    "Where is the library?", "Where do the net makers work in winter?",
    "What do the surveyors carry?", "How many passengers does the ferry carry?",
    "How many loaves fit in the oven?", "How many children does the school teach?",
    "What happens after the storm?", "What do latecomers do on market day?",
    "What is tested before a rope leaves the shed?", "What is a line struck through for?",
    "How is the library's card drawer sorted?", "Who boards the ferry without a booking?",
    "When do the bakers start work?", "How do the pupils find a ship's position?",
    "What does the lighthouse keeper log?", "Which berths can take a keel at low tide?",
]

CHAT_TURNS = [
    "Tell me about the harbour of Wrenmouth.", "What does the harbour master do at low tide?",
    "And what happens when a storm is coming?", "How do the boats stay safe in port?",
    "Who counts the boats afterwards?", "Summarise what we discussed in one sentence.",
    "Now tell me about the ferry.", "What if a traveller has no booking?",
]


def passage(tokenizer, num_tokens: int, seed: int) -> str:
    """Paragraphs in a seeded order, cycling through all of them, until the text has at
    least `num_tokens` tokens; then cut to exactly that many and decoded back."""
    rng = np.random.default_rng(seed)
    parts: list[str] = []
    ids: list[int] = []
    while len(ids) < num_tokens:
        for i in rng.permutation(len(PARAGRAPHS)):
            parts.append(PARAGRAPHS[i])
        ids = tokenizer.encode("\n\n".join(parts), add_special_tokens=False)
    return tokenizer.decode(ids[:num_tokens])
