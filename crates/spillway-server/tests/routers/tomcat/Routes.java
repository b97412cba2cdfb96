// The servlets of the Tomcat upstream of tests/proxy_routers.rs, compiled
// by the test against Tomcat's servlet API. Which one runs is decided by
// Tomcat alone: the Host container by the Host header (admin.example.com
// has a webapp of its own), the servlet by the URL mapping in each
// webapp's web.xml, the method by HttpServlet's dispatch (doHead runs
// doGet, as in every servlet).
//
// Each appends "case<TAB>handler<TAB>method<TAB>path" to the file named by
// the system property routers.log (the case is the X-Case header) and
// answers with the handler's name.
package routes;

import jakarta.servlet.http.HttpServlet;
import jakarta.servlet.http.HttpServletRequest;
import jakarta.servlet.http.HttpServletResponse;
import java.io.FileOutputStream;
import java.io.IOException;
import java.nio.charset.StandardCharsets;

public final class Routes {
    private Routes() {}

    private static synchronized void log(String line) throws IOException {
        try (FileOutputStream out = new FileOutputStream(System.getProperty("routers.log"), true)) {
            out.write(line.getBytes(StandardCharsets.UTF_8));
        }
    }

    static void handled(String name, HttpServletRequest req, HttpServletResponse res)
            throws IOException {
        String path = req.getServletPath() + (req.getPathInfo() == null ? "" : req.getPathInfo());
        log(req.getHeader("X-Case") + "\t" + name + "\t" + req.getMethod() + "\t" + path + "\n");
        res.setHeader("X-Handler", name);
        res.setContentType("text/plain");
        res.getWriter().write(name);
    }

    /** POST /login: the limited handler. */
    public static final class Login extends HttpServlet {
        @Override
        protected void doPost(HttpServletRequest req, HttpServletResponse res) throws IOException {
            handled("login", req, res);
        }
    }

    /** GET /report (and so HEAD): the limited handler of the GET rule. */
    public static final class Report extends HttpServlet {
        @Override
        protected void doGet(HttpServletRequest req, HttpServletResponse res) throws IOException {
            handled("report", req, res);
        }
    }

    /** DELETE /account: the limited handler of the DELETE rule. */
    public static final class Account extends HttpServlet {
        @Override
        protected void doDelete(HttpServletRequest req, HttpServletResponse res) throws IOException {
            handled("account", req, res);
        }
    }

    /** Everything on the admin.example.com host: the limited host. */
    public static final class Admin extends HttpServlet {
        @Override
        protected void service(HttpServletRequest req, HttpServletResponse res) throws IOException {
            handled("admin", req, res);
        }
    }

    /** Everything else. */
    public static final class Other extends HttpServlet {
        @Override
        protected void service(HttpServletRequest req, HttpServletResponse res) throws IOException {
            handled("other", req, res);
        }
    }
}
