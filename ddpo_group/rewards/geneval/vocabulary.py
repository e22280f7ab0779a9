"""GenEval's vocabulary (djghosh13/geneval ``prompts/object_names.txt`` and ``prompts/create_prompts.py``).

The 80 class names are COCO's instance classes in the detector's label order, with GenEval's own names where
COCO's are ambiguous ("computer mouse", "tv remote", "computer keyboard"). ``DETECTOR_ALIASES`` maps the names
other COCO label sets use (transformers' Mask2Former checkpoints say "mouse", "remote", "keyboard") onto them.
"""

COCO_CLASSES: tuple[str, ...] = (
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat", "traffic light",
    "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog", "horse", "sheep", "cow",
    "elephant", "bear", "zebra", "giraffe", "backpack", "umbrella", "handbag", "tie", "suitcase", "frisbee",
    "skis", "snowboard", "sports ball", "kite", "baseball bat", "baseball glove", "skateboard", "surfboard",
    "tennis racket", "bottle", "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple",
    "sandwich", "orange", "broccoli", "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch",
    "potted plant", "bed", "dining table", "toilet", "tv", "laptop", "computer mouse", "tv remote",
    "computer keyboard", "cell phone", "microwave", "oven", "toaster", "sink", "refrigerator", "book", "clock",
    "vase", "scissors", "teddy bear", "hair drier", "toothbrush",
)

# Other spellings of the COCO classes in detector label maps -> GenEval's name.
DETECTOR_ALIASES: dict[str, str] = {
    "mouse": "computer mouse", "remote": "tv remote", "keyboard": "computer keyboard", "motorbike": "motorcycle",
    "aeroplane": "airplane", "sofa": "couch", "tvmonitor": "tv", "tv monitor": "tv", "pottedplant": "potted plant",
    "diningtable": "dining table", "hair dryer": "hair drier", "doughnut": "donut", "cellphone": "cell phone",
}

COLORS: tuple[str, ...] = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
POSITIONS: tuple[str, ...] = ("left of", "right of", "above", "below")
TAGS: tuple[str, ...] = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
NUMBER_WORDS: tuple[str, ...] = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")

# The zero-shot colour prompts of GenEval's colour classifier ({c}: a colour, {cls}: the detected class).
COLOR_TEMPLATES: tuple[str, ...] = ("a photo of a {c} {cls}", "a photo of a {c}-colored {cls}", "a photo of a {c} object")


def with_article(name: str) -> str:
    """'an apple', 'a dog': GenEval's rule is the first letter (a vowel letter takes 'an')."""
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"


def plural(name: str) -> str:
    """GenEval's plural: '+es' after a final 's' ('buses', also 'skises'), else '+s' ('knifes', 'mouses')."""
    return f"{name}es" if name.endswith("s") else f"{name}s"


def geneval_class_name(label: str) -> str:
    """A detector's label in GenEval's vocabulary (``DETECTOR_ALIASES``), lower-cased; unknown labels unchanged."""
    name = label.strip().lower().replace("_", " ").replace("-", " ")
    return DETECTOR_ALIASES.get(name, name)
