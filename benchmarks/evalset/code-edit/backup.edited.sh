#!/bin/sh
set -eu

# Nightly backup: a compressed tarball of SOURCE_DIRS in $DEST/daily, a copy
# in $DEST/weekly on Sundays, and old archives pruned. Run from cron.

# Directories to back up (word-split on purpose below), and where to.
SOURCE_DIRS="/etc /home /var/lib/gitea"
DEST=${BACKUP_DEST:-/mnt/backup}
# How many daily and weekly archives to keep.
KEEP_DAILY=7
KEEP_WEEKLY=4
STAMP=$(date +%Y-%m-%d)
WEEKDAY=$(date +%u)
LOG="$DEST/backup.log"

# Append a timestamped line to the log.
log() {
    printf '%s %s\n' "$(date '+%F %T')" "$*" >> "$LOG"
}

# Create the target folders and give up early if we cannot write there.
mkdir -p "$DEST/daily" "$DEST/weekly"
[ -w "$DEST" ] || { echo "backup: $DEST is not writable" >&2; exit 1; }

# Write to a .part file first so that an interrupted run leaves no
# archive that looks complete, then add a checksum beside it.
ARCHIVE="$DEST/daily/$STAMP.tar.gz"
log "start $ARCHIVE"
tar --create --gzip --file "$ARCHIVE.part" \
    --exclude='*/.cache' --exclude='*/node_modules' \
    $SOURCE_DIRS 2>> "$LOG"
mv "$ARCHIVE.part" "$ARCHIVE"
sha256sum "$ARCHIVE" > "$ARCHIVE.sha256"

# Sundays (day 7): keep a weekly copy as well.
if [ "$WEEKDAY" -eq 7 ]; then
    cp "$ARCHIVE" "$DEST/weekly/$STAMP.tar.gz"
    cp "$ARCHIVE.sha256" "$DEST/weekly/$STAMP.tar.gz.sha256"
    log "weekly copy made"
fi

# Delete all but the newest $2 archives (and their checksums) in $1.
# Archive names are dates, so a reverse sort puts the newest first.
prune() {
    dir=$1
    keep=$2
    ls -1 "$dir"/*.tar.gz 2>/dev/null | sort -r | tail -n +"$((keep + 1))" |
        while read -r old; do
            rm -f "$old" "$old.sha256"
            log "pruned $old"
        done
}

prune "$DEST/daily" "$KEEP_DAILY"
prune "$DEST/weekly" "$KEEP_WEEKLY"

# Record the size of the new archive.
SIZE=$(du -sh "$ARCHIVE" | cut -f1)
log "done $ARCHIVE ($SIZE)"
