package health

import (
	"context"
	"encoding/json"
	"net/http"
	"sort"
	"sync"
	"time"
)

// Checker reports whether one dependency of the service is usable.
type Checker interface {
	Name() string
	Check(ctx context.Context) error
}

// Result is the outcome of one checker.
type Result struct {
	Name    string `json:"name"`
	OK      bool   `json:"ok"`
	Error   string `json:"error,omitempty"`
	Elapsed string `json:"elapsed"`
}

// RunAll runs every checker concurrently, each with at most timeout to
// finish, and returns the results sorted by name.
func RunAll(ctx context.Context, checkers []Checker, timeout time.Duration) []Result {
	results := make([]Result, len(checkers))
	var wg sync.WaitGroup
	for i, c := range checkers {
		wg.Add(1)
		go func(i int, c Checker) {
			defer wg.Done()
			cctx, cancel := context.WithTimeout(ctx, timeout)
			defer cancel()
			start := time.Now()
			err := c.Check(cctx)
			results[i] = Result{Name: c.Name(), OK: err == nil, Elapsed: time.Since(start).String()}
			if err != nil {
				results[i].Error = err.Error()
			}
		}(i, c)
	}
	wg.Wait()
	sort.Slice(results, func(a, b int) bool { return results[a].Name < results[b].Name })
	return results
}

// Handler serves the results as JSON: 200 when every check passed within
// timeout, else 503.
func Handler(checkers []Checker, timeout time.Duration) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		results := RunAll(r.Context(), checkers, timeout)
		status := http.StatusOK
		for _, res := range results {
			if !res.OK {
				status = http.StatusServiceUnavailable
				break
			}
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		_ = json.NewEncoder(w).Encode(map[string]any{"status": status, "checks": results})
	})
}

// PingChecker checks a dependency by calling a function.
type PingChecker struct {
	Label string
	Ping  func(ctx context.Context) error
}

func (p PingChecker) Name() string                    { return p.Label }
func (p PingChecker) Check(ctx context.Context) error { return p.Ping(ctx) }
