// Go's net/http server and ServeMux (standard library only) as an upstream
// of tests/proxy_routers.rs: the mux routes by path (cleaned: a path with
// dot segments or `//` is redirected) and by host (a pattern that starts
// with the host, matched against the Host without its port); handlers
// check the method as Go 1.22's "GET /report" patterns do (HEAD too).
//
// The upstream protocol: `upstream LOG` listens on a free loopback port,
// prints {"port": N} on its first line, appends
// "case<TAB>handler<TAB>method<TAB>path" to LOG for every request it routes
// (the case is the X-Case header), answers with the handler's name, and
// exits when its standard input closes.
package main

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"sync"
)

func main() {
	log, err := os.OpenFile(os.Args[1], os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
	if err != nil {
		panic(err)
	}
	var mu sync.Mutex
	handled := func(name string, w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		fmt.Fprintf(log, "%s\t%s\t%s\t%s\n", r.Header.Get("X-Case"), name, r.Method, r.URL.Path)
		mu.Unlock()
		w.Header().Set("X-Handler", name)
		io.WriteString(w, name)
	}
	only := func(name string, methods ...string) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			for _, m := range methods {
				if r.Method == m {
					handled(name, w, r)
					return
				}
			}
			handled("other", w, r)
		}
	}
	mux := http.NewServeMux()
	mux.HandleFunc("admin.example.com/", func(w http.ResponseWriter, r *http.Request) { handled("admin", w, r) })
	mux.HandleFunc("/login", only("login", http.MethodPost))
	mux.HandleFunc("/report", only("report", http.MethodGet, http.MethodHead))
	mux.HandleFunc("/account", only("account", http.MethodDelete))
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) { handled("other", w, r) })

	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		panic(err)
	}
	fmt.Printf("{\"port\": %d}\n", listener.Addr().(*net.TCPAddr).Port)
	go func() { _ = http.Serve(listener, mux) }()
	_, _ = io.Copy(io.Discard, os.Stdin)
}
