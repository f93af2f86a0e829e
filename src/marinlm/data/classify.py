"""Model-based curation: a fastText quality classifier (DCLM-style) and topic clusters.

Both models are fitted once, before the map stage, on a sample of the documents (the classifier on
a positive set against a negative set, the topics on raw input), saved under the curation's work
folder, and copied beside its shards. The map stage then scores every document with them (two
steps, in each worker); the reduce stage cuts the scores into `quality.levels` buckets at their
quantiles over the whole corpus, so a document's bucket depends on every other document and not
on which worker saw it.

Why fastText for quality: it is what DCLM and Marin used (a bag of word n-grams with a linear
layer), fast enough to score every document of a web crawl on CPUs. Why TF-IDF + k-means for topics:
deterministic, needs no embedding model, and its centroids' heaviest terms read as topic labels.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from marinlm.config import check
from marinlm.data.readers import Document, read_documents
from marinlm.data.steps import Step
from marinlm.utils.io import atomic_path, write_json_atomic

WHITESPACE = re.compile(r"\s+")
# Topic terms: words of two letters or more, and each CJK character on its own (a run of Chinese
# has no spaces; taken whole, every phrase would be a term of its own).
TERMS = r"(?u)\b[^\W\d_\u3400-\u9fff]{2,}\b|[\u3400-\u9fff]"
HIGH, LOW = "__label__hq", "__label__lq"


@dataclass(kw_only=True)
class ClassifierConfig:
    """`classifier:` in a curation config. `positive` names files of the text to keep (curated
    reference text, such as instruction data or encyclopedic articles); `negative` the text to drop,
    or nothing for a seeded sample of the curation's own raw input, as DCLM trains against."""

    enabled: bool = False
    positive: list[str] = field(default_factory=list)
    negative: list[str] = field(default_factory=list)
    text_field: str = "text"
    chunk_chars: int = 4000  # a text file of the sets is cut into documents of about this size
    sample_docs: int = 20_000  # at most this many documents of each side
    held_out: float = 0.1  # this share of each side scores the classifier, not its training
    threshold: float = 0.0  # drop documents whose quality score is below it (0 = keep all)
    levels: int = 5  # quality buckets: quantiles of the score over the curation's documents
    epochs: int = 15
    dim: int = 64
    word_ngrams: int = 2
    bucket: int = 2_000_000  # fastText's hashed word n-gram rows: the model is (bucket + words) x dim floats
    lr: float = 0.1  # fastText's default; 0.5 diverged (NaN) on a few hundred short documents
    max_chars: int = 20_000  # of each document, for training and scoring (fastText reads a line)
    seed: int = 0

    def __post_init__(self):
        check(not self.enabled or bool(self.positive), "positive", "name the files of high-quality text to learn")
        check(0.0 < self.held_out < 0.5, "held_out", f"must be in (0, 0.5), got {self.held_out}")
        check(0.0 <= self.threshold < 1.0, "threshold", f"must be in [0, 1), got {self.threshold}")
        check(self.levels >= 1, "levels", f"must be >= 1, got {self.levels}")
        check(self.sample_docs >= 10, "sample_docs", f"must be >= 10, got {self.sample_docs}")
        check(self.bucket >= 1, "bucket", f"must be >= 1, got {self.bucket}")


@dataclass(kw_only=True)
class TopicConfig:
    """`topic:` in a curation config: k-means over TF-IDF vectors of a sample of the input."""

    enabled: bool = False
    num_clusters: int = 40
    sample_docs: int = 20_000
    vocabulary: int = 20_000  # the most frequent terms of the sample (by document frequency)
    top_words: int = 8  # of each cluster, in the report
    seed: int = 0

    def __post_init__(self):
        check(self.num_clusters >= 1, "num_clusters", f"must be >= 1, got {self.num_clusters}")
        check(self.sample_docs >= self.num_clusters, "sample_docs", "must be at least num_clusters")


def one_line(text: str, max_chars: int) -> str:
    """fastText reads one document a line: whitespace runs become one space, lower case."""
    return WHITESPACE.sub(" ", text[:max_chars]).strip().lower()


def sample_texts(tasks: list[dict], limit: int, seed: int) -> list[str]:
    """A uniform sample (seeded reservoir) of up to `limit` documents of the curation's input, of
    which each input task (file or part) gives at most its first `limit`: a corpus of many small
    files is sampled whole, one huge file is not read to its end. Bad records are skipped here; the
    map stage rejects them."""
    rng = random.Random(seed)
    sample: list[str] = []
    seen = 0
    for task in tasks:
        docs = read_documents(
            Path(task["path"]), task["text_field"], task["id_field"], task["source"], task["split"],
            task.get("chunk_chars", 0), task.get("part"),
        )  # fmt: skip
        taken = 0
        for doc in docs:
            if not (isinstance(doc, Document) and doc.text.strip()):
                continue
            seen += 1
            if len(sample) < limit:
                sample.append(doc.text)
            elif (j := rng.randrange(seen)) < limit:
                sample[j] = doc.text
            taken += 1
            if taken == limit:
                break
    rng.shuffle(sample)
    return sample


def read_texts(config: ClassifierConfig, paths: list[str], what: str) -> list[str]:
    """Up to `sample_docs` documents of the files `paths` (the key `what`), shuffled."""
    from marinlm.data.inputs import expand_inputs

    texts = [
        d.text
        for path in expand_inputs(paths, what)
        for d in read_documents(path, config.text_field, chunk_chars=config.chunk_chars)
        if isinstance(d, Document) and d.text.strip()
    ]
    random.Random(config.seed).shuffle(texts)
    return texts[: config.sample_docs]


def train_classifier(config: ClassifierConfig, tasks: list[dict], work: Path) -> dict:
    """Fit the quality classifier; write WORK/quality.bin and WORK/quality.json; return the latter.
    Held-out accuracy is measured on `held_out` of each side, which the model never saw."""
    import fasttext

    positive = read_texts(config, config.positive, "classifier.positive")
    check(len(positive) >= 10, "positive", f"holds {len(positive)} documents; give at least 10")
    if config.negative:
        negative = read_texts(config, config.negative, "classifier.negative")
    else:
        negative = sample_texts(tasks, config.sample_docs, config.seed)
    check(len(negative) >= 10, "negative", f"holds {len(negative)} documents; give at least 10")
    n = min(len(positive), len(negative))  # balanced: a prior of one half, whatever the sizes
    rows = [(HIGH, t) for t in positive[:n]] + [(LOW, t) for t in negative[:n]]
    random.Random(config.seed + 1).shuffle(rows)
    cut = max(2, round(len(rows) * config.held_out))
    test, train = rows[:cut], rows[cut:]
    with atomic_path(work / "quality.train.txt") as tmp:
        tmp.write_text("".join(f"{label} {one_line(text, config.max_chars)}\n" for label, text in train))
        # One thread: fastText's Hogwild updates make a multi-threaded fit differ run to run.
        model = fasttext.train_supervised(
            input=str(tmp),
            epoch=config.epochs,
            dim=config.dim,
            wordNgrams=config.word_ngrams,
            bucket=config.bucket,
            lr=config.lr,
            thread=1,
            seed=config.seed,
            verbose=0,
        )
    scores = score_texts(model, [text for _, text in test], config.max_chars)
    correct = sum((s >= 0.5) == (label == HIGH) for s, (label, _) in zip(scores, test))
    with atomic_path(work / "quality.bin") as tmp:
        model.save_model(str(tmp))
    summary = {
        "positive_documents": n,
        "negative_documents": n,
        "negative_from": "input sample" if not config.negative else "classifier.negative",
        "trained_on": len(train),
        "held_out": len(test),
        "held_out_accuracy": correct / len(test),
    }
    write_json_atomic(work / "quality.json", summary)
    return summary


def score_texts(model, texts: list[str], max_chars: int) -> list[float]:
    """P(high quality) of each text."""
    labels, probs = model.predict([one_line(t, max_chars) for t in texts], k=2)
    return [float(dict(zip(ls, ps)).get(HIGH, 0.0)) for ls, ps in zip(labels, probs)]


def fit_topics(config: TopicConfig, tasks: list[dict], work: Path) -> dict:
    """k-means over TF-IDF vectors of a sample of the input; writes WORK/topics.npz (vocabulary,
    idf, centroids) and WORK/topics.json (each cluster's top words and sample size)."""
    from sklearn.cluster import KMeans
    from sklearn.feature_extraction.text import TfidfVectorizer

    texts = sample_texts(tasks, config.sample_docs, config.seed)
    check(
        len(texts) >= config.num_clusters,
        "num_clusters",
        f"{config.num_clusters} is more than the {len(texts)} documents sampled",
    )
    settings = dict(max_features=config.vocabulary, sublinear_tf=True, token_pattern=TERMS, stop_words="english")
    vectorizer = TfidfVectorizer(min_df=2, **settings)
    try:
        vectors = vectorizer.fit_transform(texts)
    except ValueError:  # too few words repeat across documents: keep every term
        vectorizer = TfidfVectorizer(**settings)
        vectors = vectorizer.fit_transform(texts)
    kmeans = KMeans(n_clusters=config.num_clusters, n_init=3, random_state=config.seed).fit(vectors)
    centroids = kmeans.cluster_centers_.astype(np.float32)
    terms = vectorizer.get_feature_names_out()
    clusters = []
    for k, centroid in enumerate(centroids):
        top = [str(terms[i]) for i in np.argsort(-centroid)[: config.top_words]]
        clusters.append({"topic": k, "sampled": int((kmeans.labels_ == k).sum()), "top_words": top})
    with atomic_path(work / "topics.npz") as tmp, open(tmp, "wb") as f:
        idf = vectorizer.idf_.astype(np.float32)
        np.savez(f, vocabulary=np.asarray(terms, dtype=str), idf=idf, centroids=centroids)
    summary = {"sampled": len(texts), "clusters": clusters}
    write_json_atomic(work / "topics.json", summary)
    return summary


def batched(docs, size: int):
    """Lists of up to `size` documents of the stream `docs`: the models score a batch in one call."""
    batch: list[Document] = []
    for doc in docs:
        batch.append(doc)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


class QualityScore(Step):
    """Scores each document with the quality classifier (metadata `quality_score`); below
    `threshold`, the document is dropped, counted as `quality_classifier`."""

    name = "quality_classifier"

    def __init__(self, config: ClassifierConfig, model_path: Path, batch: int = 256):
        self.config, self.model_path, self.batch, self._model = config, model_path, batch, None

    def run(self, docs, ctx):
        import fasttext

        if self._model is None:
            self._model = fasttext.load_model(str(self.model_path))
        for batch in batched(docs, self.batch):
            yield from self._score(batch, ctx)

    def _score(self, docs: list[Document], ctx):
        for doc, score in zip(docs, score_texts(self._model, [d.text for d in docs], self.config.max_chars)):
            doc.metadata["quality_score"] = round(score, 6)
            if score < self.config.threshold:
                ctx.drop(self.name, doc, "quality score below threshold", {"score": score})
            else:
                yield doc


class TopicAssign(Step):
    """The nearest topic centroid (cosine) of each document's TF-IDF vector: metadata `topic`."""

    name = "topic"

    def __init__(self, model_path: Path, batch: int = 256):
        self.model_path, self.batch, self._fitted = model_path, batch, None

    def _load(self):
        from sklearn.feature_extraction.text import TfidfVectorizer

        saved = np.load(self.model_path)
        vocabulary = {str(t): i for i, t in enumerate(saved["vocabulary"])}
        vectorizer = TfidfVectorizer(vocabulary=vocabulary, sublinear_tf=True, token_pattern=TERMS)
        vectorizer.idf_ = saved["idf"]
        return vectorizer, saved["centroids"]

    def run(self, docs, ctx):
        if self._fitted is None:
            self._fitted = self._load()
        for batch in batched(docs, self.batch):
            yield from self._assign(batch)

    def _assign(self, docs: list[Document]):
        vectorizer, centroids = self._fitted
        topics = np.asarray((vectorizer.transform([d.text for d in docs]) @ centroids.T).argmax(axis=1)).ravel()
        for doc, topic in zip(docs, topics):
            doc.metadata["topic"] = int(topic)
            yield doc


def _fit(args: tuple) -> dict:
    fit, config, tasks, work = args
    return fit(config, tasks, work)


def fit_models(config, tasks: list[dict], work: Path, say) -> dict:
    """Fit what the config enables and an earlier run did not (resumable: each model is written
    atomically, its summary last). Returns {"quality": summary, "topics": summary}.

    Each fit runs in a spawned process: k-means starts OpenMP threads (scikit-learn's own runtime),
    and a process forked after them (the curation's workers, a test's) could hang on a lock one of
    them held."""
    from marinlm.utils.pool import call_in_child

    fitted = {}
    for key, section, fit, summary, what in (
        ("quality", config.classifier, train_classifier, "quality.json", "training the quality classifier"),
        ("topics", config.topic, fit_topics, "topics.json", "clustering a sample of the input into topics"),
    ):
        if not section.enabled:
            continue
        done = work / summary
        if not done.is_file():
            say(f"curate: {what}")
            call_in_child(_fit, (fit, section, tasks, work))
        fitted[key] = json.loads(done.read_text())
    return fitted


def level_edges(scores: np.ndarray, levels: int) -> np.ndarray:
    """The `levels - 1` inner quantiles of `scores`: level 0 the lowest scores, levels - 1 the highest."""
    if len(scores) == 0 or levels == 1:
        return np.zeros(0)
    return np.quantile(scores, np.arange(1, levels) / levels)


def level_of(scores: np.ndarray, edges: np.ndarray) -> np.ndarray:
    return np.searchsorted(edges, scores, side="right").astype(np.int64)


def cell_name(topic: int | None, level: int | None) -> str:
    """A topic x quality cell's name, e.g. `t07-q4` (`q4` with no topics, `t07` with no classifier)."""
    parts = ([f"t{topic:02d}"] if topic is not None else []) + ([f"q{level}"] if level is not None else [])
    return "-".join(parts) or "all"
