-- Schema for the community library's lending database (PostgreSQL).

CREATE TABLE members (
    id          BIGSERIAL PRIMARY KEY,
    card_number TEXT NOT NULL UNIQUE,
    full_name   TEXT NOT NULL,
    email       TEXT,
    joined_on   DATE NOT NULL DEFAULT CURRENT_DATE,
    active      BOOLEAN NOT NULL DEFAULT TRUE
);

CREATE TABLE books (
    id           BIGSERIAL PRIMARY KEY,
    isbn         TEXT UNIQUE,
    title        TEXT NOT NULL,
    author       TEXT NOT NULL,
    published_in INTEGER CHECK (published_in BETWEEN 1450 AND 2100),
    shelf        TEXT NOT NULL
);

CREATE TABLE copies (
    id        BIGSERIAL PRIMARY KEY,
    book_id   BIGINT NOT NULL REFERENCES books (id) ON DELETE CASCADE,
    barcode   TEXT NOT NULL UNIQUE,
    condition TEXT NOT NULL DEFAULT 'good'
        CHECK (condition IN ('new', 'good', 'worn', 'damaged'))
);

CREATE TABLE loans (
    id          BIGSERIAL PRIMARY KEY,
    copy_id     BIGINT NOT NULL REFERENCES copies (id),
    member_id   BIGINT NOT NULL REFERENCES members (id),
    borrowed_on DATE NOT NULL DEFAULT CURRENT_DATE,
    due_on      DATE NOT NULL,
    returned_on DATE,
    CHECK (due_on > borrowed_on),
    CHECK (returned_on IS NULL OR returned_on >= borrowed_on)
);

CREATE TABLE reservations (
    id          BIGSERIAL PRIMARY KEY,
    book_id     BIGINT NOT NULL REFERENCES books (id) ON DELETE CASCADE,
    member_id   BIGINT NOT NULL REFERENCES members (id),
    reserved_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    fulfilled   BOOLEAN NOT NULL DEFAULT FALSE,
    UNIQUE (book_id, member_id)
);

CREATE INDEX loans_member_idx ON loans (member_id);
CREATE INDEX loans_open_idx ON loans (copy_id) WHERE returned_on IS NULL;
CREATE INDEX books_author_idx ON books (author);
CREATE INDEX reservations_open_idx ON reservations (book_id, reserved_at) WHERE NOT fulfilled;

-- At most one open loan per copy.
CREATE UNIQUE INDEX loans_one_open_per_copy ON loans (copy_id) WHERE returned_on IS NULL;

CREATE VIEW overdue_loans AS
SELECT l.id AS loan_id,
       m.full_name,
       m.email,
       b.title,
       c.barcode,
       l.due_on,
       CURRENT_DATE - l.due_on AS days_late
FROM loans l
JOIN members m ON m.id = l.member_id
JOIN copies c ON c.id = l.copy_id
JOIN books b ON b.id = c.book_id
WHERE l.returned_on IS NULL
  AND l.due_on < CURRENT_DATE;
