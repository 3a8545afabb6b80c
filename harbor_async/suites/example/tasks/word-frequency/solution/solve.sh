#!/bin/sh
# Reference solution: lower-case, split on non-letters, drop stop words, count.
tr 'A-Z' 'a-z' < /workdir/story.txt \
    | tr -cs 'a-z' '\n' \
    | grep -v '^$' \
    | grep -vxF -f /workdir/stopwords.txt \
    | sort | uniq -c | sort -k1,1nr -k2,2 \
    | head -n 1 | awk '{print $2}' > /workdir/answer.txt
