// Command wordfreq prints the most frequent words of its input files.
package main

import (
	"bufio"
	"flag"
	"fmt"
	"os"
	"sort"
	"strings"
	"unicode"
)

func main() {
	n := flag.Int("n", 10, "how many words to print")
	minLen := flag.Int("min", 1, "shortest word counted")
	flag.Parse()
	counts := map[string]int{}
	for _, path := range flag.Args() {
		lines, err := readLines(path)
		if err != nil {
			fmt.Fprintln(os.Stderr, "wordfreq:", err)
			os.Exit(1)
		}
		for _, line := range lines {
			countWords(line, *minLen, counts)
		}
	}
	printTop(topN(counts, *n))
}

type wordCount struct {
	word  string
	count int
}

func topN(counts map[string]int, n int) []wordCount {
	all := make([]wordCount, 0, len(counts))
	for w, c := range counts {
		all = append(all, wordCount{w, c})
	}
	sort.Slice(all, func(i, j int) bool {
		if all[i].count != all[j].count {
			return all[i].count > all[j].count
		}
		return all[i].word < all[j].word
	})
	if len(all) > n {
		all = all[:n]
	}
	return all
}

func readLines(path string) ([]string, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var lines []string
	scanner := bufio.NewScanner(f)
	for scanner.Scan() {
		lines = append(lines, scanner.Text())
	}
	return lines, scanner.Err()
}

func printTop(words []wordCount) {
	width := 0
	for _, wc := range words {
		if len(wc.word) > width {
			width = len(wc.word)
		}
	}
	for _, wc := range words {
		fmt.Printf("%-*s %6d\n", width, wc.word, wc.count)
	}
}

func countWords(line string, minLen int, counts map[string]int) {
	fields := strings.FieldsFunc(line, func(r rune) bool {
		return !unicode.IsLetter(r) && r != '\''
	})
	for _, f := range fields {
		w := strings.ToLower(strings.Trim(f, "'"))
		if len([]rune(w)) >= minLen {
			counts[w]++
		}
	}
}
